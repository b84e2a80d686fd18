"""qft against the stock Hugging Face QLoRA recipe on the same work, alternating, in one invocation.

    python benchmarks/speed.py                      # SmolLM2-135M, BBC News, NF4, r=8 on all 7 projections
    python benchmarks/speed.py --seq 128 --steps 10 # the longer-sequence point
    python benchmarks/speed.py --unfused            # also qft with accel.fuse_projections=false, alternating
    python benchmarks/speed.py --also quant.attention_dtype=fp32   # also qft with a switch, alternating
    python benchmarks/speed.py --reps 6 --target 2.2  # is 2.2x met? the repetitions' ratios as an interval
    python benchmarks/speed.py --read results/FILE.json --target 2.2   # the same, from a file already there

Each measurement is its own process (so start-up and peak RSS are clean), in the order qft, baseline,
qft, baseline, ...; the medians and the qft/baseline ratios go to benchmarks/results/. The dense bf16
matmul ceiling is measured in the same run, before and after, and qft's model FLOPs utilisation is the
useful forward + backward FLOPs of its steps over that ceiling. A target is judged on the repetitions' paired
ratios (`ratio_interval`), never on one ratio of medians; `ratio_bound` says what the matmul rate allows.
"""

from __future__ import annotations

import argparse
import shutil
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # an emulated CPU kind


def overrides(a) -> list[str]:
    return [f"train.steps={a.steps}", f"train.batch_size={a.batch}", f"data.max_length={a.seq}", "train.lr=1e-3",
            "train.warmup_steps=2", "train.eval_every=0", "train.checkpoint_every=0", "train.zero_shot=false",
            f"data.train_size={a.batch * a.steps}", "data.val_size=10", f"data.test_size={a.test}",
            "adapter.dropout=0.05", "sweep.force=true", *a.qft_overrides]  # never reuse an earlier record


def compose(a):
    from hydra import compose as hydra_compose, initialize_config_dir

    from qft.config import CONF

    from qft import schema

    with initialize_config_dir(CONF, version_base="1.3"):
        return schema.complete(hydra_compose("config", overrides=overrides(a)))


class _Started(Exception):
    """Raised where a later run's training loop would begin."""


def until_training(cfg, run_dir: Path) -> None:
    """Run a config in this process, as Hydra's basic launcher runs a sweep's later jobs (imports paid, model
    converted, data tokenized, quantized base cached), until its training loop begins: the span this script and
    startup.py time as a later run's start-up."""
    from qft import run, train

    inner = train.train

    def stop(*args, **kw):
        raise _Started
    train.train = stop
    try:
        run.run(cfg, run_dir)
    except _Started:
        return
    finally:
        train.train = inner
    raise SystemExit(f"a run in {run_dir} finished without reaching its training loop")


def run_qft(a, t0: float, out: dict) -> None:
    """One measured run, then the start-up of a second run in the same process (`until_training`)."""
    from qft import run, train

    inner, marks, finish, ends = train.train, {}, train.finish_step, []

    def timed(*args, **kw):  # start-up = launch until the training loop begins
        marks["first_step"] = time.time()
        return inner(*args, **kw)

    def step_end(*args, **kw):
        finish(*args, **kw)
        ends.append(time.perf_counter())

    train.train, train.finish_step = timed, step_end
    rec = run.run(compose(a), Path(a.workdir))
    out.update(startup_seconds=marks["first_step"] - t0, tokens_per_second=rec["train_tokens_per_second"],
               train_seconds=rec["train_seconds"], train_tokens=rec["train_tokens"],
               test_accuracy=rec["final_accuracy"]["test"], final_loss=rec["loss_curve"][-1][1],
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               steady_tokens_per_second=steady(rec["train_tokens"], ends),
               qft_source=(rec.get("execution") or {}).get("qft_source"))
    t_freeze = time.time()
    train.freeze_survivors()  # what qft's task function does between a sweep's runs; timed apart
    t1 = time.time()
    out["sweep_freeze_seconds"] = t1 - t_freeze
    until_training(compose(a), Path(a.workdir + "-next"))
    out["sweep_startup_seconds"] = time.time() - t1


def code_versions(runs: list[dict]) -> list[str | None]:
    """The qft sources (record.py's digest of qft/ and conf/ as each process read them) its runs ran, None for a run
    that recorded none."""
    return sorted({r.get("qft_source") for r in runs if r["kind"] != "baseline"}, key=str)


def one_source(sources: list[str | None], name: str) -> None:
    """Exit 1 (after the file is written) unless every qft run read one known source: where the checkout changed
    during the invocation its ratios compare different code."""
    if len(sources) != 1 or sources[0] is None:
        raise SystemExit(f"speed.py: qft's runs did not all read one known source ({', '.join(map(str, sources))}): "
                         f"{name}.json records them, but its ratios are no comparison of one code")


def paired_ratios(runs: list[dict], key: str, kind: str = "qft", over: str = "baseline") -> list[float]:
    """`kind`'s value over `over`'s within each repetition `kind` ran in, in order: runs next to each other in time
    share the host's pace, which on these VMs drifts by up to 1.7x within an hour, so the spread of these ratios says
    how much one invocation's ratio of medians can be trusted."""
    by = {(r["rep"], r["kind"]): r[key] for r in runs}
    return [by[rep, kind] / by[rep, over] for rep in sorted(r["rep"] for r in runs if r["kind"] == kind)]


def steady(tokens: int, step_ends: list[float]) -> float:
    """Tokens/s once running: a step's mean tokens over the median time between consecutive step ends, the first
    step (lazy initialisation, first touch of the activations' memory) left out. What a long run sees. The median
    resists this VM's stalls; it assumes steps of about equal size (BBC prompts fill the window: a batch of 16 x 64
    here holds 1,005 real tokens on average of the 1,024 it could)."""
    return tokens / len(step_ends) / statistics.median(b - a for a, b in zip(step_ends, step_ends[1:]))


def run_baseline(a, t0: float, out: dict) -> None:
    """The best plain use of the stock stack: from_pretrained + BitsAndBytesConfig, prepare_model_for_kbit_training,
    get_peft_model, HF Trainer; the same tokenized examples, answer-only labels, batch, lr and steps."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback, TrainingArguments

    from qft import data, evaluate, model

    cfg = compose(a)
    source = model.resolve(cfg.model, cfg.cache_dir)
    tok = model.load_tokenizer(source)
    task = data.prepare(cfg.data, tok, cfg.cache_dir)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.baseline_dtype]
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=dtype)
    net = AutoModelForCausalLM.from_pretrained(source.weights, quantization_config=q, device_map="cpu")
    net = prepare_model_for_kbit_training(net, use_gradient_checkpointing=False)
    net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=PROJ,
                                         task_type="CAUSAL_LM"))
    split = task.splits["train"]
    rows = [{"input_ids": p + ans, "labels": [-100] * len(p) + ans} for p, ans in zip(split.prompts, split.answers)]
    counted = {"tokens": 0}

    def collate(batch):  # right-padded to the batch's longest, as DataCollatorForSeq2Seq does
        width = max(len(r["input_ids"]) for r in batch)
        counted["tokens"] += sum(len(r["input_ids"]) for r in batch)
        pad = tok.pad_token_id
        return {"input_ids": torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in batch]),
                "labels": torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in batch]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))
                                                for r in batch])}

    args = TrainingArguments(output_dir=a.workdir, per_device_train_batch_size=a.batch, max_steps=a.steps,
                             learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine", bf16=dtype == torch.bfloat16,
                             use_cpu=True,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, max_grad_norm=1.0,
                             weight_decay=0.0, dataloader_num_workers=0, remove_unused_columns=False,
                             disable_tqdm=True)
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())

    trainer = Trainer(model=net, args=args, train_dataset=rows, data_collator=collate, callbacks=[StepEnds()])
    out["startup_seconds"] = time.time() - t0
    t = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - t
    tok.padding_side = "left"
    acc = evaluate.accuracy(net, task, "test", tok, 32, dtype)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out.update(tokens_per_second=counted["tokens"] / seconds, train_seconds=seconds, train_tokens=counted["tokens"],
               test_accuracy=acc, final_loss=losses[-1] if losses else result.training_loss,
               steady_tokens_per_second=steady(counted["tokens"], ends))


def machine() -> dict:
    """Where and when a measurement ran: threads, torch's CPU capability, the CPU, its kind (amx_bf16, avx512_bf16,
    avx2, ...) and id, the date, and any instruction-set cap put on torch, oneDNN and MKL (an emulated kind is not
    the kind). One comparison must not mix them."""
    import torch

    from qft import record

    cpu, kind = record.cpu_kind()
    return {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu, "cpu_kind": kind, "cpu_id": record.cpu_id(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "isa_caps": {k: os.environ[k] for k in ISA_CAPS if k in os.environ}}


def tagged(name: str, overrides: list[str], cpu_kind: str, isa_caps: dict) -> str:
    """A result file's name: what it measured, the overrides, and the CPU kind it ran on (an instruction-set cap
    marked), so that invocations on two kinds never overwrite each other."""
    name += "".join("-" + o.replace("=", "_") for o in overrides)
    return name + f"-{cpu_kind}" + ("-capped_" + "_".join(sorted({v.lower() for v in isa_caps.values()})) if isa_caps else "")


def result_name(a, cpu_kind: str, isa_caps: dict) -> str:
    """The summary's file name (`tagged`): the workload, then the --also switches, then qft's overrides."""
    name = f"speed-seq{a.seq}-steps{a.steps}-baseline_{a.baseline_dtype}" + ("-unfused" if a.unfused else "")
    return tagged(name + "".join("-also-" + o.replace("=", "_") for o in a.also), a.qft_overrides, cpu_kind, isa_caps)


def worker(a) -> None:
    t0 = float(os.environ["QFT_BENCH_T0"])
    out = {"kind": a.worker}
    if a.worker == "qft_unfused":
        a.qft_overrides = [*a.qft_overrides, "accel.fuse_projections=false"]
    if a.worker == "qft_also":
        a.qft_overrides = [*a.qft_overrides, *a.also]
    (run_baseline if a.worker == "baseline" else run_qft)(a, t0, out)
    out.setdefault("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    Path(a.json_out).write_text(json.dumps(out))


def matmul_ceiling(dtype: str = "bf16", n: int = 1024, seconds: float = 1.0) -> float:
    """Dense matmul throughput in `dtype` on this machine, GFLOP/s: best of 3 batches of about `seconds`
    each (time-boxed, because emulated bf16 on a CPU without bf16 units runs at well under 1 GFLOP/s)."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x, y = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    x @ y
    best = 0.0
    for _ in range(3):
        t, reps = time.perf_counter(), 0
        while time.perf_counter() - t < seconds:
            x @ y
            reps += 1
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9)
    return best


D, KV, FF, LAYERS, VOCAB = 576, 192, 1536, 30, 49152  # SmolLM2-135M
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, FF), (D, FF), (FF, D)]  # q k v o gate up down: (in, out)


def step_shape_ceiling(tokens: int, dtype: str = "bf16", reps: int = 3) -> float:
    """GFLOP/s of the frozen base's own matmuls of one step (forward and input gradient of the seven projections
    of 30 layers, at the step's token count) run back to back: what the matmul library reaches at these
    shapes, against which the 2048^3 ceiling is a bound no small-model step can approach."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    ws = [torch.randn(o, i, dtype=dt) for i, o in SHAPES]
    xs = [torch.randn(tokens, i, dtype=dt) for i, _ in SHAPES]
    gs = [torch.randn(tokens, o, dtype=dt) for _, o in SHAPES]

    def step():
        for _ in range(LAYERS):
            for w, x, g in zip(ws, xs, gs):
                x @ w.t()
                g @ w

    step()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return LAYERS * sum(4 * i * o for i, o in SHAPES) * tokens / best / 1e9


def useful_flops_per_step(a, tokens_per_step: float, answer_tokens_per_step: float) -> float:
    """Forward + backward FLOPs a step needs: frozen projections (forward and input gradient), LoRA
    (forward, input and weight gradients), attention scores, and the LM head at the answer positions only."""
    d, layers, vocab, r, shapes = D, LAYERS, VOCAB, 8, SHAPES
    base = sum(4 * i * o for i, o in shapes)
    lora = sum(6 * r * (i + o) for i, o in shapes)
    attn = 3 * 4 * (a.seq / 2) * d  # QK^T and AV, forward + 2x backward, causal average length
    head = 4 * d * vocab
    return layers * (base + lora + attn) * tokens_per_step + head * answer_tokens_per_step


def ratio_bound(summary: dict) -> dict:
    """What the matmul rate allows in this invocation, an estimate. `at_ceiling` (`at_step_shapes`): the ratio qft
    would reach with its useful FLOPs a step at the measured 1024^3 rate of its compute dtype (at the rate of the
    step's own frozen shapes back to back, often higher) against the stock recipe's measured pace (steady; whole-run
    in files before steady rates). Neither rate is a hard ceiling, so neither is a hard bound. `flops_ratio`: the
    stock recipe's FLOPs a step over qft's (its LM head runs over every position); qft's ratio is its useful FLOP
    rate over the stock recipe's, times this, so the ratio tends to it where both run near the matmul rate.
    `stock_mfu`: the stock recipe's FLOPs at its pace over the 1024^3 rate of its own compute dtype."""
    s = summary["settings"]
    qft = [r for r in summary["runs"] if r["kind"] == "qft"]
    tokens = statistics.median(r["train_tokens"] / s["steps"] for r in qft)
    shape = argparse.Namespace(seq=s["seq"])
    flops = useful_flops_per_step(shape, tokens, s["batch"] * 1.2)
    stock_flops = useful_flops_per_step(shape, tokens, tokens)
    pace = "steady_tokens_per_second" if "steady_tokens_per_second" in summary else "tokens_per_second"
    stock = summary[pace]["baseline"]
    ceilings = summary["matmul_ceiling_gflops"]
    rates = {"ceiling": ceilings[summary.get("qft_compute_dtype", s["baseline_dtype"])],
             "step_shapes": summary.get("step_shape_matmul_gflops")}
    out = {f"at_{k}": tokens / (flops / (g * 1e9)) / stock for k, g in rates.items() if g}
    out["flops_ratio"] = stock_flops / flops
    out["stock_mfu"] = stock_flops * stock / tokens / (ceilings[s["baseline_dtype"]] * 1e9)
    out.update(stock_pace=pace, qft_ratio=summary[pace]["ratio_qft_over_baseline"])
    return out


def ratio_interval(ratios: list[float], target: float | None = None, level: float = 0.90) -> dict:
    """The repetitions' paired ratios as a geometric mean with a t-interval on their logs, and where a target is
    given, whether it is met: "met" where the interval's lower end is at or above it, "short" where its upper end
    is below it, "unresolved" otherwise. At the 90% level each end is a one-sided test at 0.05, as TOST's two are.
    Reads the repetitions as independent draws of the host's pace, which drifts within an hour: alternate and
    repeat more (`--reps`) rather than read one invocation's ratio of medians against a target."""
    from qft.stats import t_quantile

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out = {"n": len(logs), "geometric_mean": math.exp(mean), "level": level, "low": None, "high": None}
    if len(logs) > 1:
        half = t_quantile(len(logs) - 1, level) * statistics.stdev(logs) / math.sqrt(len(logs))
        out.update(low=math.exp(mean - half), high=math.exp(mean + half))
    if target is not None:
        out["target"] = target
        out["verdict"] = ("met" if out["low"] is not None and out["low"] >= target else
                          "short" if out["high"] is not None and out["high"] < target else "unresolved")
    return out


def numbered(runs: list[dict]) -> list[dict]:
    """Runs of files written before runs carried their repetition: each kind's n-th run is repetition n, as the
    invocation ran them (each repetition all kinds in turn)."""
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        out.append({"rep": seen.get(r["kind"], 0), **r})
        seen[r["kind"]] = seen.get(r["kind"], 0) + 1
    return out


def describe(name: str, summary: dict, target: float | None) -> str:
    """One results file's ratios in a line: each repetition's, their interval, a target's verdict, the matmul's bound."""
    b = ratio_bound(summary)
    pace = b["stock_pace"]
    ratios = (summary[pace].get("ratio_qft_over_baseline_per_rep")
              or paired_ratios(numbered(summary["runs"]), pace))
    ci = ratio_interval(ratios, target)  # no runs, or a ratio at or below 0: a ValueError
    span = (f"{ci['low']:.2f}-{ci['high']:.2f} ({ci['level']:.0%} interval, {ci['n']} repetitions)"
            if ci["low"] else f"no interval from {ci['n']} repetition")
    verdict = f"; target {target}x: {ci['verdict']}" if target is not None else ""
    shapes = f", {b['at_step_shapes']:.2f}x at the step's shapes' rate" if "at_step_shapes" in b else ""
    return (f"{name}: qft {b['qft_ratio']:.2f}x the stock recipe ({pace}), each repetition "
            f"{', '.join(f'{r:.2f}' for r in ratios)}: {span}{verdict}. With its useful FLOPs at the measured "
            f"1024^3 matmul rate qft would be {b['at_ceiling']:.2f}x{shapes}; {b['flops_ratio']:.2f}x where both "
            f"run at it (the stock recipe at {b['stock_mfu']:.0%} of its dtype's rate here)")


def read(files: list[str], target: float | None) -> None:
    """Results files already there, each described again (`describe`)."""
    for f in files:
        try:
            print(describe(Path(f).name, json.loads(Path(f).read_text()), target))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(print(f"speed.py: error: --read {f}: not a speed.py results file with the fields read "
                                   f"here ({e!r})", file=sys.stderr) or 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--baseline-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="the stock recipe's bnb_4bit_compute_dtype (bf16 is the published QLoRA recipe)")
    ap.add_argument("--unfused", action="store_true",
                    help="also run qft with accel.fuse_projections=false, in turn with the others (fusion's own gain)")
    ap.add_argument("--also", action="append", default=[], metavar="OVERRIDE",
                    help="also run qft with this override added (repeatable), in turn with the others")
    ap.add_argument("--worker", choices=["qft", "qft_unfused", "qft_also", "baseline"])
    ap.add_argument("--json-out")
    ap.add_argument("--workdir")
    ap.add_argument("--target", type=float, help="a qft / stock ratio to judge the repetitions' interval against")
    ap.add_argument("--read", nargs="+", metavar="RESULT", help="run nothing: read results files again (each "
                    "repetition's ratio, their interval, --target's verdict, the ratio the matmul rate allows)")
    ap.add_argument("qft_overrides", nargs="*", help="extra qft overrides, e.g. accel.cache_dequantized=true")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.read:
        return read(a.read, a.target)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from qft.model import compute_dtype_name

    qft_dtype = compute_dtype_name(compose(a).quant.compute_dtype)  # what qft computes in on this machine
    ceiling = {d: [matmul_ceiling(d)] for d in ("bf16", "fp32")}
    runs = []
    for rep in range(a.reps):
        for kind in ("qft", *["qft_unfused"] * a.unfused, *["qft_also"] * bool(a.also), "baseline"):
            work = out_dir / f"work-{kind}-{rep}"
            shutil.rmtree(work, ignore_errors=True)
            js = out_dir / f".{kind}-{rep}.json"
            env = {**os.environ, "QFT_BENCH_T0": str(time.time()), "QFT_PROGRESS": "0"}
            cmd = [sys.executable, __file__, "--worker", kind, "--json-out", str(js), "--workdir", str(work),
                   "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq), "--test", str(a.test),
                   "--baseline-dtype", a.baseline_dtype, *[x for o in a.also for x in ("--also", o)], *a.qft_overrides]
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            runs.append({**json.loads(js.read_text()), "rep": rep})
            js.unlink()
            print(json.dumps(runs[-1]), flush=True)
    for d in ceiling:
        ceiling[d].append(matmul_ceiling(d))

    def med(kind, key):
        return statistics.median(r[key] for r in runs if r["kind"] == kind)

    keys = ("tokens_per_second", "steady_tokens_per_second", "startup_seconds", "peak_rss_bytes", "test_accuracy",
            "final_loss")
    summary = {k: {"qft": med("qft", k), "baseline": med("baseline", k)} for k in keys}
    summary["qft_sweep_startup_seconds"] = med("qft", "sweep_startup_seconds")
    summary["qft_sweep_freeze_seconds"] = med("qft", "sweep_freeze_seconds")  # once, after a process's first run
    for k in keys:
        summary[k]["ratio_qft_over_baseline"] = summary[k]["qft"] / summary[k]["baseline"]
        summary[k]["ratio_qft_over_baseline_per_rep"] = paired_ratios(runs, k)
        if a.unfused:
            summary[k]["qft_unfused"] = med("qft_unfused", k)
            summary[k]["ratio_qft_over_unfused"] = summary[k]["qft"] / summary[k]["qft_unfused"]
            summary[k]["ratio_qft_over_unfused_per_rep"] = paired_ratios(runs, k, "qft", "qft_unfused")
        if a.also:
            summary[k]["qft_also"] = med("qft_also", k)
            summary[k]["ratio_qft_also_over_qft"] = summary[k]["qft_also"] / summary[k]["qft"]
            summary[k]["ratio_qft_also_over_qft_per_rep"] = paired_ratios(runs, k, "qft_also", "qft")
    q = [r for r in runs if r["kind"] == "qft"]
    tokens_per_step = statistics.median(r["train_tokens"] / a.steps for r in q)
    flops = useful_flops_per_step(a, tokens_per_step, a.batch * 1.2)  # BBC label words: 1.2 tokens on average
    step_seconds = statistics.median(r["train_seconds"] / a.steps for r in q)
    summary["matmul_ceiling_gflops"] = {d: statistics.median(v) for d, v in ceiling.items()}
    summary["qft_compute_dtype"] = qft_dtype
    summary["qft_useful_gflops"] = flops / step_seconds / 1e9
    summary["qft_mfu"] = summary["qft_useful_gflops"] / summary["matmul_ceiling_gflops"][qft_dtype]
    summary["step_shape_matmul_gflops"] = step_shape_ceiling(int(tokens_per_step), qft_dtype)
    summary["qft_over_step_shape_matmul"] = summary["qft_useful_gflops"] / summary["step_shape_matmul_gflops"]
    summary["settings"] = {"steps": a.steps, "batch": a.batch, "seq": a.seq, "reps": a.reps, "test": a.test,
                           "baseline_dtype": a.baseline_dtype, "qft_overrides": a.qft_overrides, "also": a.also,
                           **machine()}
    summary["qft_sources"] = code_versions(runs)
    summary["runs"] = runs
    summary["ratio_bound"] = ratio_bound(summary)
    summary["ratio_interval"] = {k: ratio_interval(summary[k]["ratio_qft_over_baseline_per_rep"], a.target)
                                 for k in ("tokens_per_second", "steady_tokens_per_second")}
    name = result_name(a, summary["settings"]["cpu_kind"], summary["settings"]["isa_caps"])
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    print(describe(f"{name}.json", summary, a.target))
    one_source(summary["qft_sources"], name)


if __name__ == "__main__":
    main()
