"""An execution switch on against off, in one process (`--loops masks`: `accel.compiled_masks`; `sums`:
`accel.compiled_sums`; `rope`: `accel.compiled_rope`; `rows`: `accel.split_rows`, no compiled loop): steps alternate between the two on the same
model, batches and memory state, so the machine's drift between processes (5-10% on these VMs) falls on both alike.

    python benchmarks/compiled.py                                                   # masks; 12 steps each, after 2
    python benchmarks/compiled.py --loops sums quant.attention_dtype=fp32 accel.cache_dequantized=true
    python benchmarks/compiled.py --loops rows quant.attention_dtype=fp32 accel.cache_dequantized=true
    python benchmarks/compiled.py --loops rope

The workload is `speed.py`'s (SmolLM2-135M, BBC News, batch 16 x 64, its lr and dropout); a step is the training
step of `step_ops.py` (answer loss, backward, clipping, AdamW). The other switches stay as the config sets them. The
medians and their ratio go to benchmarks/results/compiled_{loops}-seq{N}[-threads{T}][-overrides]-{cpu kind}.json (the
thread count where it is not one per usable core) (its keys
`compiled` and `torch_ops` name the switch on and off, for every switch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import speed
import step_ops
from qft import accel


def _fused(cfg) -> bool:
    return accel.switches(cfg, "cpu")["fuse_projections"]


# what a config needs for the switch to act (the key to name, whether it holds, what is allowed), and the objects'
# flag: masks, sums and rope are numba loops, none where numba is not installed (rope: nor for another rotary function)
NEEDS = {
    "masks": ("adapter.dropout_mask", lambda cfg: cfg.adapter.dropout_mask == "fast" and cfg.adapter.dropout > 0,
              "only fast masks compile: needs adapter.dropout_mask=fast and adapter.dropout > 0",
              "compiled"),
    "sums": ("accel.fuse_projections", _fused,
             "the compiled sums run in fused groups: needs accel.fuse_projections=true", "compiled"),
    "rope": ("accel.compiled_rope", lambda cfg: True, "", "compiled"),
    "rows": ("accel.fuse_projections", _fused,
             "the row blocks run in fused groups: needs accel.fuse_projections=true", "split_rows"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loops", choices=tuple(NEEDS), default="masks", help="which switch alternates")
    ap.add_argument("--pairs", type=int, default=12, help="steps with the loops compiled, and as many without")
    ap.add_argument("--out", default=str(speed.ROOT / "benchmarks" / "results"))
    ap.add_argument("qft_overrides", nargs="*", help="qft overrides, e.g. quant.attention_dtype=fp32")
    a = ap.parse_args()
    from omegaconf import OmegaConf

    from qft import model
    from qft.accel import fuse, masks, rope
    from qft.errors import QftError

    n = a.warmup + 2 * a.pairs
    cfg = step_ops.compose(a.batch, a.seq, n, a.qft_overrides)
    key, holds, allowed, attr = NEEDS[a.loops]
    if not holds(cfg):
        raise QftError(key, OmegaConf.select(cfg, key), allowed)
    net, step = step_ops.workload(cfg)
    switched = {"masks": masks.compile_masks, "sums": fuse.compile_sums, "rope": rope.compile_rope,
                "rows": fuse.split_rows}[a.loops](net)
    if not switched and attr == "compiled":
        import importlib.util

        raise QftError(f"train.compiled_{a.loops}", True, "numba is not installed (pip install numba)"
                       if importlib.util.find_spec("numba") is None
                       else "this model's rotary function is not the one qft.accel.kernels.rope computes")
    seconds = {True: [], False: []}
    for i in range(n):
        on = i % 2 == 0
        for m in switched:
            setattr(m, attr, on)
        t = time.perf_counter()
        step(i)
        if i >= a.warmup:
            seconds[on].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {"step_seconds_median": {"compiled": med[True], "torch_ops": med[False]},
           "ratio_compiled_over_torch_ops": med[True] / med[False],
           "step_seconds": {"compiled": seconds[True], "torch_ops": seconds[False]},
           "settings": {"batch": a.batch, "seq": a.seq, "warmup": a.warmup, "pairs": a.pairs,
                        "qft_overrides": a.qft_overrides,
                        "compute_dtype": model.compute_dtype_name(cfg.quant.compute_dtype), **speed.machine()}}
    threads = "" if torch.get_num_threads() == len(os.sched_getaffinity(0)) else f"-threads{torch.get_num_threads()}"
    name = speed.tagged(f"compiled_{a.loops}-seq{a.seq}{threads}", a.qft_overrides, out["settings"]["cpu_kind"],
                        out["settings"]["isa_caps"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{name}.json").write_text(json.dumps(out, indent=1))
    print(f"{out['settings']['cpu']}, {out['settings']['threads']} threads, {out['settings']['compute_dtype']}: "
          f"a step {med[True]:.3f} s with the {a.loops} on, {med[False]:.3f} s with them off "
          f"(medians of {a.pairs} each): ratio {out['ratio_compiled_over_torch_ops']:.3f}")


if __name__ == "__main__":
    from qft.errors import QftError

    try:
        main()
    except QftError as e:
        raise SystemExit(print(f"compiled.py: error: {e}", file=sys.stderr) or 2)
