"""qft.tools.memory's estimate against the measured peak of real training steps, config by config.

    OMP_NUM_THREADS=1 python benchmarks/memory.py              # every config, each in its own process
    python benchmarks/memory.py --only smollm2-nf4-b16-s64     # one of them
    python benchmarks/memory.py --device cuda --out benchmarks/results/memory-cuda.json   # on a GPU
    python benchmarks/memory.py --reestimate                   # new estimates for the stored measurements

Each config is built as qft.run.build builds it (the packaged SmolLM2-135M or tiny_llama, quantized,
adapters attached) on BBC News batches, then runs two training steps as qft.train does (answer loss,
backward, clipping, AdamW step, zero_grad); the second is measured (qft.planning.measure.measure_peak: the CPU
allocator's events through torch.profiler, torch.cuda.max_memory_allocated on CUDA), so the optimizer
states already exist. Measured peak = resident tensors (model + optimizer state) + the step's peak above
them. The estimate is qft.tools.memory.estimate of the same config, from the config alone: sequence length
data.max_length, the default answer length and padded batches. A second estimate is also told the batch's
real width, answer tokens and padding. Results go to benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "memory.json"
TRAIN = ["train.eval_every=0", "train.checkpoint_every=0", "train.zero_shot=false", "data.val_size=10",
         "data.test_size=10", "data.train_size=64"]
# name -> overrides; compute_dtype=auto is fp32 on a CPU without bf16 units, bf16 configs run the autocast path
CONFIGS = {
    "smollm2-nf4-b16-s64": ["model=smollm2_135m", "train.batch_size=16", "data.max_length=64"],
    "smollm2-attn8_mlp4-b8-s128": ["model=smollm2_135m", "quant=attn8_mlp4", "train.batch_size=8",
                                   "data.max_length=128"],
    "smollm2-nf4-b16-s128-ckpt": ["model=smollm2_135m", "train.batch_size=16", "data.max_length=128",
                                  "train.gradient_checkpointing=true"],
    "smollm2-nf4-bf16-b4-s64": ["model=smollm2_135m", "quant.compute_dtype=bf16", "train.batch_size=4",
                                "data.max_length=64"],
    "smollm2-int8-bf16-b4-s64-r16": ["model=smollm2_135m", "quant=int8", "quant.compute_dtype=bf16",
                                     "train.batch_size=4", "data.max_length=64", "adapter.attn.r=16",
                                     "adapter.mlp.r=4"],
    "tiny-nf4-bf16-b16-s64": ["model=tiny_llama", "quant.compute_dtype=bf16", "train.batch_size=16",
                              "data.max_length=64"],
    "tiny-int8-bf16-b16-s64-ckpt": ["model=tiny_llama", "quant=int8", "quant.compute_dtype=bf16",
                                    "train.batch_size=16", "data.max_length=64", "train.gradient_checkpointing=true"],
    "smollm2-nf4-bf16-b4-s64-fastmask": ["model=smollm2_135m", "quant.compute_dtype=bf16", "train.batch_size=4",
                                         "data.max_length=64", "adapter.dropout_mask=fast"],
    "smollm2-nf4-b16-s64-fused": ["model=smollm2_135m", "train.batch_size=16", "data.max_length=64",
                                  "accel.fuse_projections=true"],
    "smollm2-nf4-bf16-b4-s64-fused": ["model=smollm2_135m", "quant.compute_dtype=bf16", "train.batch_size=4",
                                      "data.max_length=64", "accel.fuse_projections=true"],
}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from qft import schema
    from qft.config import CONF

    with initialize_config_dir(CONF, version_base="1.3"):
        mask = [] if any(o.startswith("adapter.dropout_mask=") for o in overrides) else \
            ["adapter.dropout_mask=torch"]  # what the stored measurements ran with, before the fast mask existed
        if not any(o.startswith("accel.fuse_projections=") for o in overrides):
            mask.append("accel.fuse_projections=false")  # and before fused projections
        return schema.complete(hydra_compose(
            "config", overrides=TRAIN + [f"device={os.environ.get('QFT_BENCH_DEVICE', 'cpu')}"] + mask + overrides))


def first_batch(cfg, source):
    """The step's batch as qft.train draws it (BBC News, tokenized as a run does), and its shape."""
    from qft import data, model, train

    tok = model.load_tokenizer(source)
    task = data.prepare(cfg.data, tok, cfg.cache_dir)
    split = task.splits["train"]
    idx = train.micro_batch_indices(len(split.prompts), cfg.train.batch_size, 1, cfg.seed)
    batch = ([split.prompts[i] for i in idx], [split.answers[i] for i in idx])
    lengths = [len(p) + len(a) for p, a in zip(*batch)]
    shape = {"batch_width": max(lengths), "answer_tokens": max(map(len, batch[1])),
             "answer_rows": sum(map(len, batch[1])), "padded": len(set(lengths)) > 1}
    return batch, tok.pad_token_id, shape


def estimates(cfg, source, shape: dict) -> dict:
    """The estimate from the config alone, and the one that also knows the batch's shape."""
    from qft.tools import memory

    est = memory.estimate(cfg, source)
    shaped = memory.estimate(_with_width(cfg, shape["batch_width"]), source, answer_tokens=shape["answer_tokens"],
                             answer_rows=shape["answer_rows"], padded=shape["padded"])
    return {"compute_dtype": est.compute_dtype, "estimate_bytes": est.peak, "components": est.components,
            "estimated_answer_tokens": est.answer, "estimate_batch_shape_bytes": shaped.peak}


def measure(name: str, only_estimate: bool = False) -> dict:
    """Build the config's model, run two steps on its first BBC News batch, measure the second."""
    import torch

    from qft import model, run
    from qft.planning import measure

    cfg = compose(CONFIGS[name])
    t0 = time.time()
    source = model.resolve(cfg.model, cfg.cache_dir)
    batch, pad_id, shape = first_batch(cfg, source)
    out = {"name": name, "overrides": CONFIGS[name], **shape, **estimates(cfg, source, shape)}
    if only_estimate:
        return out
    device = torch.device(cfg.device)
    built = run.build(cfg, source, device)
    dtype = model.compute_dtype(cfg.quant.compute_dtype, device)
    m = measure.measure_step(built.model, cfg.train, [batch], pad_id, dtype)
    return _errors({**out, "measured_bytes": m["peak"], "resident_bytes": m["resident"], "step_peak_bytes": m["step"],
                    "seconds": time.time() - t0})


def _errors(r: dict) -> dict:
    return {**r, "relative_error": r["estimate_bytes"] / r["measured_bytes"] - 1,
            "relative_error_batch_shape": r["estimate_batch_shape_bytes"] / r["measured_bytes"] - 1}


def _with_width(cfg, width: int):
    """The config with data.max_length set to the batch's real width (an estimate knowing the batch)."""
    import copy

    from omegaconf import open_dict

    out = copy.deepcopy(cfg)
    with open_dict(out):
        out.data.max_length = width
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=list(CONFIGS), action="append", help="run only these configs")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the estimates of the stored results with the current qft.tools.memory, measure nothing")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(measure(a.worker, a.reestimate)), flush=True)
        return 0
    out = Path(a.out)
    rows = {r["name"]: r for r in json.loads(out.read_text())["configs"]} if out.exists() else {}
    for name in a.only or (list(rows) if a.reestimate else CONFIGS):
        env = {**os.environ, "QFT_PROGRESS": "0", "QFT_BENCH_DEVICE": a.device}
        cmd = [sys.executable, __file__, "--worker", name] + (["--reestimate"] if a.reestimate else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)  # one process each: clean memory
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows[name] = r = _errors({**rows.get(name, {}), **json.loads(line[7:])})
        print(f"{name}: estimate {r['estimate_bytes'] / 2**30:.3f} GiB, measured {r['measured_bytes'] / 2**30:.3f} GiB,"
              f" error {r['relative_error']:+.1%} (knowing the batch's shape {r['relative_error_batch_shape']:+.1%})",
              flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": "OMP_NUM_THREADS=1 python benchmarks/memory.py"
                                   + (" --device cuda" if a.device == "cuda" else ""), "machine": _machine(),
                                   "configs": [rows[n] for n in CONFIGS if n in rows]}, indent=1))
    print("\n| config | compute | measured GiB | estimate GiB (config only) | error | estimate GiB (batch shape) "
          "| error |\n|---|---|---:|---:|---:|---:|---:|")
    for n in CONFIGS:
        if n in rows:
            r = rows[n]
            print(f"| {n} | {r['compute_dtype']} | {r['measured_bytes'] / 2**30:.4f} | "
                  f"{r['estimate_bytes'] / 2**30:.4f} | {r['relative_error']:+.1%} | "
                  f"{r['estimate_batch_shape_bytes'] / 2**30:.4f} | {r['relative_error_batch_shape']:+.1%} |")
    return 0


def _machine() -> dict:
    import platform

    import torch

    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu,
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}


if __name__ == "__main__":
    sys.exit(main())
