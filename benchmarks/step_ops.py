"""Where a qft training step goes, op by op: every aten (and bitsandbytes) op of a few steps timed as it runs, and
qft.accel.kernels' compiled loops as ops of their own (`qft.accel.kernels.NAME`, the aten ops they call inside
counted in them).

    python benchmarks/step_ops.py                                   # SmolLM2-135M, BBC News, batch 16 x 64, defaults
    python benchmarks/step_ops.py quant.attention_dtype=fp32 --top 20
    python benchmarks/step_ops.py --split aten._to_copy,aten.add,aten.mul     # those ops by shapes and dtypes

torch.profiler's per-op times on a small VM were not the ops' own (the fused gate/up matmul read 26-30 ms there
against 19-20 ms timed in the step), so each op is timed by a dispatch mode with a clock around the call, which
costs about 0.3 s a step of Python and is left out of the per-op figures. The model, data, batches, optimizer and
clipping are those of `speed.py`'s qft run (no schedule); the steps timed come after warm-up steps.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import sys
import time
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import speed


class OpTimer(TorchDispatchMode):
    """Seconds and calls per op; matmuls also by their operands' shapes, where the size decides the speed."""

    def __init__(self, split: tuple[str, ...] = ()):
        super().__init__()
        self.ops = collections.defaultdict(lambda: [0, 0.0])
        self.split = split  # further ops keyed by their operands' shapes and dtypes (--split)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t
        name = str(func.overloadpacket)
        if name in ("aten.mm", "aten.bmm", "aten.addmm"):
            name += " " + " x ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))
        elif name in self.split:
            name += " " + " x ".join(f"{str(a.dtype)[6:]}{list(a.shape)}" for a in args if isinstance(a, torch.Tensor))
            if isinstance(out, torch.Tensor):
                name += f" -> {str(out.dtype)[6:]}"
        self.ops[name][0] += 1
        self.ops[name][1] += dt
        return out

    def timed(self, name: str, f):
        """f, timed as one op (qft.accel.kernels' loops are numba code, which the dispatcher does not see). The aten
        ops it calls (its outputs' allocations) run outside this mode: through it each cost some 20-50 us of Python,
        which made a loop's time in a step seem 1.2-1.5x what a plain clock around it reads."""
        def call(*args):
            t = time.perf_counter()
            try:
                with _disable_current_modes():
                    return f(*args)
            finally:
                self.ops[name][0] += 1
                self.ops[name][1] += time.perf_counter() - t
        return call


def compose(batch: int, seq: int, steps: int, overrides: list[str]):
    """`speed.py`'s qft config for this workload."""
    return speed.compose(SimpleNamespace(steps=steps, batch=batch, seq=seq, test=10, qft_overrides=overrides))


def workload(cfg):
    """The model of a `compose`d config and one training step of it (step(i) trains on batch i), as `speed.py`'s qft
    run builds and trains it (no schedule)."""
    from qft import accel, data, model, run, train

    batch = cfg.train.batch_size
    accel.tune_host_allocator(accel.switches(cfg, "cpu")["host_allocator"])
    source = model.resolve(cfg.model, cfg.cache_dir)
    tokenizer = model.load_tokenizer(source)
    split = data.prepare(cfg.data, tokenizer, cfg.cache_dir).splits["train"]
    net = run.build(cfg, source, torch.device("cpu")).model
    dtype = model.compute_dtype(cfg.quant.compute_dtype)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = train.make_optimizer(cfg.train, params)
    net.train()

    def step(i: int) -> None:
        idx = train.micro_batch_indices(len(split.prompts), batch, i, cfg.seed)
        loss, answer_tokens, _ = train.answer_loss(net, [split.prompts[j] for j in idx],
                                                   [split.answers[j] for j in idx], tokenizer.pad_token_id, dtype)
        (loss / answer_tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return net, step


@contextlib.contextmanager
def compiled_loops_timed(timer: OpTimer):
    """qft.accel.kernels' public loops timed as ops of their own, `qft.accel.kernels.NAME`, where numba is installed."""
    try:
        from qft.accel import kernels
    except ImportError:
        yield
        return
    names = kernels.LOOPS
    own = {n: getattr(kernels, n) for n in names}
    try:
        for n in names:
            setattr(kernels, n, timer.timed(f"qft.accel.kernels.{n}", own[n]))
        yield
    finally:
        for n in names:
            setattr(kernels, n, own[n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--split", default="", metavar="OPS",
                    help="comma-separated ops to key by operand shapes and dtypes, e.g. aten._to_copy,aten.add")
    ap.add_argument("qft_overrides", nargs="*", help="qft overrides, e.g. quant.compute_dtype=fp32")
    a = ap.parse_args()
    from qft import model, record

    n = a.warmup + a.steps
    cfg = compose(a.batch, a.seq, n, a.qft_overrides)
    net, step = workload(cfg)

    for i in range(a.warmup):
        step(i)
    timer = OpTimer(tuple(o for o in a.split.split(",") if o))
    t = time.perf_counter()
    with timer, compiled_loops_timed(timer):
        for i in range(a.warmup, n):
            step(i)
    wall = (time.perf_counter() - t) / a.steps
    in_ops = sum(s for _, s in timer.ops.values()) / a.steps
    print(f"{record.cpu_kind()[0]}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"{model.compute_dtype_name(cfg.quant.compute_dtype)}; {a.steps} steps of batch {a.batch} x {a.seq} "
          f"after {a.warmup}")
    print(f"a step: {wall:.4f} s timed, {in_ops:.4f} s in ops\n")
    print("| op | ms a step | share of the ops | calls a step |\n|---|---:|---:|---:|")
    for name, (calls, s) in sorted(timer.ops.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"| `{name}` | {1e3 * s / a.steps:.2f} | {s / a.steps / in_ops:.1%} | {calls // a.steps} |")


if __name__ == "__main__":
    from qft.errors import QftError

    try:
        main()
    except QftError as e:
        raise SystemExit(print(f"step_ops.py: error: {e}", file=sys.stderr) or 2)
