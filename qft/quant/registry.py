"""Quantization backends: one class per kind of frozen projection, found by its settings or by its module.

Every place that used to ask "is this 4-bit?" (building, caching, describing, counting bytes, the memory model,
qft.accel.fuse) asks the backend instead, so a new kind is one file: a subclass of `Backend` in qft/quant/ (imported
with the package) or anywhere else, then `register(...)`.
"""

from __future__ import annotations

import torch
from torch import nn

BACKENDS: dict[str, "Backend"] = {}


class Backend:
    """What qft needs of one kind of frozen projection. The defaults fit a module that is an nn.Linear subclass
    holding its weight as a tensor it computes with."""

    name: str = ""
    bits: int = 16
    quant_types: tuple[str, ...] = ()  # the 4-bit formats (quant.*.quant_type) it serves; empty: any
    modules: tuple[type, ...] = ()  # the module classes it builds
    output_in_input_dtype = False  # under autocast its output keeps its input's dtype (fp32 residual stream)
    pins_input = False  # its matmul keeps its input on its own autograd node, past checkpointing
    holds_dequantized = False  # accel.cache_dequantized applies to it
    fuses = False  # qft.accel.fuse can run a group of its projections as one (see fuse_kind)

    def quantize(self, linear: nn.Linear, s: dict, compute_dtype: torch.dtype, device) -> nn.Module:
        raise NotImplementedError

    def tensors(self, q: nn.Module) -> dict[str, torch.Tensor]:
        """What rebuilds the module without quantizing again (the quantized-base cache)."""
        out = {"weight": q.weight.data}
        if q.bias is not None:
            out["bias"] = q.bias.data
        return out

    def rebuild(self, t: dict, s: dict, in_f: int, out_f: int, compute_dtype: torch.dtype, device,
                at: str | None) -> nn.Module:
        """The module from `tensors`; built on `at` ("meta" or None: the default device, drawing the RNG as
        `quantize` draws it)."""
        raise NotImplementedError

    def dequantized(self, q: nn.Module) -> nn.Module:
        """The module with its weight held dequantized in the compute dtype (accel.cache_dequantized)."""
        return q

    def weight(self, q: nn.Module) -> torch.Tensor:
        """The weight the module computes with, in fp32."""
        return q.weight.data.float()

    def describe(self, q: nn.Module) -> str:
        return str(q.weight.dtype).replace("torch.", "")

    def format(self, s: dict, compute_dtype: str) -> str:
        """What `describe` will say of a module built with settings `s` (for the memory model, before building)."""
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[compute_dtype]

    def module_bytes(self, q: nn.Module) -> int:
        """Bytes the module's frozen weight really holds."""
        return sum(t.numel() * t.element_size() for t in list(q.parameters(recurse=False)) +
                   list(q.buffers(recurse=False)))

    def weight_bytes(self, s: dict, in_f: int, out_f: int, compute_bytes: int, bias: bool) -> int:
        """`module_bytes` in closed form, from the settings alone (the memory model plans on the meta device)."""
        raise NotImplementedError

    def work_bytes(self, n: int, compute_bytes: int, device: str) -> tuple[int, int]:
        """Transient bytes of one call on an n-weight projection, forward and backward (a dequantized copy)."""
        return 0, 0

    # qft.accel.fuse: "stored" runs a group on one concatenated weight tensor (each member's weight a view of it);
    # "computed" makes the group's weight per use with `fused_weight`; None runs the module on its own.
    def fuse_kind(self, q: nn.Module) -> str | None:
        return None

    def compute_dtype(self, q: nn.Module) -> torch.dtype:
        return q.weight.dtype

    def fusable(self, q: nn.Module, device: torch.device) -> bool:
        """Whether a computed weight of `q` equals what its own forward computes with, on `device`."""
        return False

    def fused_weight(self, q: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


def register(backend: Backend) -> Backend:
    """Add a backend; its (bits, quant_type) must not overlap another's."""
    for other in BACKENDS.values():
        if other.name != backend.name and other.bits == backend.bits and (
                not other.quant_types or not backend.quant_types or set(other.quant_types) & set(backend.quant_types)):
            raise ValueError(f"backend {backend.name!r} serves what {other.name!r} serves ({backend.bits} bits)")
    BACKENDS[backend.name] = backend
    return backend


def for_settings(s: dict) -> Backend:
    for b in BACKENDS.values():
        if b.bits == s["bits"] and (not b.quant_types or s.get("quant_type") in b.quant_types):
            return b
    raise KeyError(f"no quantization backend for bits={s['bits']} quant_type={s.get('quant_type')}")


def for_module(q: nn.Module) -> Backend | None:
    """The backend that built `q` (exact class: a subclass of nn.Linear is not a 16-bit projection)."""
    for b in BACKENDS.values():
        if type(q) in b.modules:
            return b
    return None


def bits() -> list[int]:
    return sorted({b.bits for b in BACKENDS.values()})


def quant_types() -> list[str]:
    return [t for b in BACKENDS.values() for t in b.quant_types]
