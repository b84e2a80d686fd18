"""Would shared-input LoRA pay on a CPU? The LoRA paths of a q/k/v group, forward and backward, four ways, in turn.

    python benchmarks/lora_inputs.py                 # SmolLM2-135M's attention group, batch 16 x seq 64, r=8
    python benchmarks/lora_inputs.py --tokens 4096

- peft: each projection draws its own dropout mask, then its own A and B matmuls (what qft runs, fused or not);
- batched: the same masks drawn in the same order, the three A matmuls as one batched matmul over the stacked
  masked inputs (the exact variant the speed issue proposed), B per projection;
- shared mask: one mask for the group (a different model of dropout: each projection sees the same dropped input),
  A and B per projection (adapter.shared_dropout=true);
- shared mask, one A matmul: that, and one matmul over the concatenated A matrices.
Each with torch's Bernoulli masks and qft's fast masks (adapter.dropout_mask), under bf16 autocast as a CPU run
computes. Times are medians over repetitions, alternating, and reported as ratios to peft's within this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from qft.adapter import FastDropout

RESULTS = Path(__file__).resolve().parent / "results"


def group(tokens: int, hidden: int, outs: list[int], r: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    a = [torch.randn(r, hidden, generator=g).mul_(0.02).requires_grad_() for _ in outs]
    b = [torch.randn(o, r, generator=g).mul_(0.02).requires_grad_() for o in outs]
    return x, a, b


def peft(x, a, b, drop):
    return [nn.functional.linear(nn.functional.linear(drop(x), ai), bi) for ai, bi in zip(a, b)]


def batched(x, a, b, drop):
    mid = torch.bmm(torch.stack([drop(x) for _ in a]), torch.stack(a).transpose(1, 2))
    return [nn.functional.linear(m, bi) for m, bi in zip(mid, b)]


def shared_mask(x, a, b, drop):
    d = drop(x)
    return [nn.functional.linear(nn.functional.linear(d, ai), bi) for ai, bi in zip(a, b)]


def shared(x, a, b, drop):
    mid = nn.functional.linear(drop(x), torch.cat(a)).split([ai.shape[0] for ai in a], dim=-1)
    return [nn.functional.linear(m, bi) for m, bi in zip(mid, b)]


def step(way, x, a, b, drop) -> None:
    with torch.autocast("cpu", torch.bfloat16):
        outs = way(x, a, b, drop)
    sum(o.float().sum() for o in outs).backward()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16 * 64)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--outs", type=int, nargs="+", default=[576, 192, 192], help="q, k, v widths (SmolLM2-135M)")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    from qft.record import cpu_kind

    x, A, B = group(a.tokens, a.hidden, a.outs, a.r)
    masks = {"torch": nn.Dropout(0.05), "fast": FastDropout(0.05)}
    ways = {"peft": peft, "batched": batched, "shared mask": shared_mask, "shared mask, one A matmul": shared}
    times = {(m, w): [] for m in masks for w in ways}
    for _ in range(a.reps):
        for (m, w) in times:
            for t in [x, *A, *B]:
                t.grad = None
            start = time.perf_counter()
            step(ways[w], x, A, B, masks[m])
            times[(m, w)].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[("torch", "peft")]
    kind = cpu_kind()
    print(f"CPU: {kind[0]} ({kind[1]}), {torch.get_num_threads()} threads; {a.tokens} tokens, hidden {a.hidden}, "
          f"outputs {a.outs}, r={a.r}; forward + backward of the group's LoRA paths, median of {a.reps}")
    print("| masks | way | ms | vs peft, same masks | vs peft, torch masks |\n|---|---|---|---|---|")
    for (m, w), t in med.items():
        print(f"| {m} | {w} | {t * 1e3:.2f} | {t / med[(m, 'peft')]:.2f} | {t / base:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"lora_inputs-{a.tokens}.json"
    out.write_text(json.dumps({"cpu": kind, "threads": torch.get_num_threads(), "args": vars(a),
                               "median_seconds": {f"{m}/{w}": t for (m, w), t in med.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
