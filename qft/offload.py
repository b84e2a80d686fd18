"""Activation offload (offload=activations): tensors saved for backward live in host memory between forward and
backward, since at long sequences they, not QLoRA's 4-bit base, fill a GPU. On CUDA the copies overlap compute (a
side stream, pinned buffers, prefetch in backward); on CPU the same path runs without streams, proving correctness
only. Parameters and small tensors stay put, as in torchtune's OffloadActivations (docs/memory.md).
"""

from __future__ import annotations

import contextlib

import torch

from qft import schema
from qft.errors import QftError


def check(cfg) -> None:
    """Check the offload section `cfg`; raises QftError naming offload.* on a bad value or a stage count that does
    not fit the mode."""
    schema.check(cfg, "offload")
    if cfg.mode == "pipeline" and cfg.stages < 2:
        raise QftError("offload.stages", cfg.stages, "offload.mode=pipeline needs 2 or more stages")
    if cfg.mode != "pipeline" and cfg.stages != 1:
        raise QftError("offload.stages", cfg.stages, "1 unless offload.mode=pipeline")


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep activations in host memory between forward and backward."""

    def __init__(self, min_bytes: int = 1024, prefetch: int = 2, pin_memory: bool = True,
                 via: torch.device | None = None):
        """`via`: a peer GPU (NVLink neighbour) whose PCIe link carries the copies to and from the host,
        leaving this GPU's own link free (the route of Liu, Lai, Li's memory-balanced pipeline)."""
        self.min_bytes, self.prefetch, self.via = min_bytes, prefetch, via
        self.host: dict[int, tuple[torch.Tensor, torch.device]] = {}
        self.ready: dict[int, tuple[torch.Tensor, object]] = {}  # prefetched back on the device
        self.in_flight: list[tuple[torch.Tensor, object]] = []  # device tensors whose copy out is running
        self.count = 0
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.pin = pin_memory and self.cuda
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < self.min_bytes \
                or t.device.type == "meta":
            return t
        handle = self.count
        self.count += 1
        if t.device.type == "cuda":
            host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                if self.via is not None:  # over NVLink to the neighbour, then over its PCIe link
                    host.copy_(t.to(self.via, non_blocking=True), non_blocking=True)
                else:
                    host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.in_flight.append((t, done))  # keep the device tensor alive until its copy is out
            self.in_flight = [(x, e) for x, e in self.in_flight if not e.query()]
        else:
            host = t.detach().clone()
        self.host[handle] = (host, t.device)
        return handle

    def _fetch(self, handle: int):
        host, device = self.host.pop(handle)
        if device.type != "cuda":
            return host, None
        with torch.cuda.stream(self.stream):
            t = (host.to(self.via, non_blocking=True) if self.via is not None else host).to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return t, done

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        handle = packed
        t, done = self.ready.pop(handle, None) or self._fetch(handle)
        if done is not None:
            torch.cuda.current_stream(t.device).wait_event(done)
            t.record_stream(torch.cuda.current_stream(t.device))
        # backward runs in reverse order of forward: the tensors packed just before are needed next
        if self.cuda:
            for h in range(handle - 1, max(-1, handle - 1 - self.prefetch), -1):
                if h in self.host and h not in self.ready:
                    self.ready[h] = self._fetch(h)
        return t


def neighbour(device: torch.device) -> torch.device:
    """The NVLink pair partner (0-1, 2-3, ...) of the GPU `device`. Raises QftError (offload.route) where `device` is
    not CUDA or cannot reach its partner's memory directly."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise QftError("offload.route", "neighbour", "needs CUDA GPUs with peer access (an NVLink bridge); use host")
    i = device.index if device.index is not None else torch.cuda.current_device()
    j = i ^ 1
    if j >= torch.cuda.device_count() or not torch.cuda.can_device_access_peer(i, j):
        raise QftError("offload.route", "neighbour", f"GPU {i} has no peer access to GPU {j}; use host")
    return torch.device("cuda", j)


def hooks(cfg, device: torch.device):
    """The context a forward on `device` runs under: ActivationOffload hooks where the offload section `cfg` says
    mode activations (its route and prefetch), else a null context (also for `cfg` None)."""
    if cfg is None or cfg.mode != "activations":
        return contextlib.nullcontext()
    via = neighbour(device) if cfg.route == "neighbour" else None
    return ActivationOffload(prefetch=2 if cfg.prefetch else 0, pin_memory=device.type == "cuda", via=via)
