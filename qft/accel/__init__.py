"""The CPU speed layer: switches that change no number, only how fast a step runs (docs/memory.md).

`install` puts on a built model what its config asks for and its device allows, and says what ran; the run records
that in `execution`. `tune_host_allocator` is the one process-wide switch, set before the weights load.

- fuse.py: projections that read one input run as one frozen matmul (`fuse_projections`, `compiled_sums`,
  `split_rows`);
- masks.py, rope.py: the fast dropout masks and the rotary embedding as compiled loops (`compiled_masks`,
  `compiled_rope`);
- kernels.py: the numba loops; probe.py: the bit-for-bit checks the switches make at install.

The switches themselves (accel.mode and its eight accel.* overrides) are declared and resolved in one place,
qft.schema (`accel_switches`); this package reads them only through it.
"""

from __future__ import annotations

import sys

import torch

from qft import schema

# the switches installed on a built model, as the record's `execution` names them: all CPU code
MODEL_SWITCHES = schema.cpu_only("accel")

__all__ = ["MODEL_SWITCHES", "install", "on_device", "switches", "tune_host_allocator"]


def switches(cfg, device) -> dict:
    """{switch: setting} as a run on `device` ("cpu", "cuda", "cuda:1" or a torch.device) applies them: the schema's
    `accel_switches` (`host_allocator` a name, tuned | default; the others booleans), with the CPU-only ones
    (MODEL_SWITCHES) off elsewhere: the compiled loops are CPU code, and fusion has not been shown to change no number
    on CUDA (scripts/gpu_check.py compares it there), so an explicit accel=cpu on CUDA installs none of them."""
    on_cpu = str(getattr(device, "type", device)).split(":")[0] == "cpu"
    return {k: bool(v) and on_cpu if k in MODEL_SWITCHES else v for k, v in schema.accel_switches(cfg, device).items()}


def on_device(cfg, device) -> dict[str, bool]:
    """{switch: asked for and applies} for MODEL_SWITCHES on `device`: what `install` installs at most, and what the
    memory model plans."""
    on = switches(cfg, device)
    return {k: on[k] for k in MODEL_SWITCHES}


def install(net, cfg, device: torch.device, projections: list, model_type: str,
            threads: int | None = None) -> dict[str, bool]:
    """Install on `net` (peft-wrapped or plain) the switches `cfg` asks for that apply on `device` (`on_device`: on
    the CPU only); returns {switch: whether it ran} for MODEL_SWITCHES.

    A switch runs where it applies and found something to change (no numba, no fast masks, no fused groups, a
    refused rotary form: off). `threads`: torch's thread count the run computes at (default: the current one);
    at one thread `split_rows` never splits, so it is not installed."""
    from qft.accel import fuse, masks, rope

    on = on_device(cfg, device)
    threads = torch.get_num_threads() if threads is None else threads
    ran = dict.fromkeys(MODEL_SWITCHES, False)
    if on["compiled_masks"]:
        ran["compiled_masks"] = bool(masks.compile_masks(net))
    if on["compiled_rope"]:
        ran["compiled_rope"] = bool(rope.compile_rope(net))
    if on["fuse_projections"]:
        fuse.install(net, projections, model_type)
        ran["fuse_projections"] = True
        if on["compiled_sums"]:
            ran["compiled_sums"] = bool(fuse.compile_sums(net))
        if on["split_rows"] and threads > 1:
            ran["split_rows"] = bool(fuse.split_rows(net))
    return ran


def tune_host_allocator(how: str) -> bool:
    """With `how` "tuned" (accel.host_allocator, as `switches` resolves it), keep freed host memory in glibc's heap
    instead of returning it to the kernel; returns whether it did (a no-op outside glibc).

    By default glibc serves every block over its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh mmap
    and unmaps it on free, so each step's activations page-fault and are zeroed again. The peak stays the live
    tensors' peak; only the give-back is deferred (tests/test_speed_switches.py)."""
    if how != "tuned" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
