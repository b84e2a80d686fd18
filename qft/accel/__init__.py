"""The CPU speed layer: switches that change no number, only how fast a step runs (docs/memory.md).

`install` puts the switches on a built model and returns what ran (the record's `execution`); `tune_host_allocator`
is the one process-wide switch. fuse.py: grouped projections (fuse_projections, compiled_sums, split_rows); masks.py,
rope.py: compiled masks and rotary; kernels.py: the numba loops; probe.py: the bit-for-bit checks at install.
The switches are declared and resolved in qft.schema (`accel_switches`) only.
"""

from __future__ import annotations

import sys

import torch

from qft import schema

# the switches installed on a built model, as the record's `execution` names them: all CPU code
MODEL_SWITCHES = schema.cpu_only("accel")

__all__ = ["MODEL_SWITCHES", "install", "on_device", "switches", "tune_host_allocator"]


def switches(cfg, device) -> dict:
    """{switch: setting} of accel group `cfg` as a run on `device` ("cpu", "cuda:1", a torch.device) applies them:
    `host_allocator` a name (tuned | default), the others booleans, MODEL_SWITCHES off except on a CPU.

    CPU only: the loops are CPU code, and fusion is not shown to keep every number on CUDA."""
    on_cpu = str(getattr(device, "type", device)).split(":")[0] == "cpu"
    return {k: bool(v) and on_cpu if k in MODEL_SWITCHES else v for k, v in schema.accel_switches(cfg, device).items()}


def on_device(cfg, device) -> dict[str, bool]:
    """{switch: asked for by `cfg` and applies on `device`} for MODEL_SWITCHES: what `install` installs at most and
    the memory model plans."""
    on = switches(cfg, device)
    return {k: on[k] for k in MODEL_SWITCHES}


def install(net, cfg, device: torch.device, projections: list, model_type: str,
            threads: int | None = None) -> dict[str, bool]:
    """Install on `net` (peft-wrapped or plain) the switches of `cfg` that apply on `device`; returns {switch: whether
    it ran} for MODEL_SWITCHES (off where nothing was found to change, or numba is missing).

    `projections`, `model_type`: what fuse groups (the architecture's); `threads`: torch's thread count the run
    computes at (default: the current one; at one, split_rows is not installed)."""
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
    """Where `how` is "tuned" (accel.host_allocator), keep freed host memory in glibc's heap (mallopt); returns
    whether it did (False outside glibc).

    glibc otherwise mmaps each large block afresh and unmaps it on free, so every step's activations page-fault
    again; the peak stays the live tensors' peak."""
    if how != "tuned" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
