"""Quantization backends: one class per kind of frozen projection, found by its settings or by its module.

Building, caching, describing, counting bytes, the memory model and qft.accel.fuse ask the backend, so a new kind is
one file: a subclass of `Backend` in qft/quant/ (imported with the package) or anywhere else, then `register(...)`.
"""

from __future__ import annotations

import torch
from torch import nn

BACKENDS: dict[str, "Backend"] = {}


class Backend:
    """What qft needs of one kind of frozen projection; the defaults fit an nn.Linear subclass that computes with
    the weight tensor it holds. `s` below is one projection's quantization settings (quant.plan)."""

    name: str = ""
    bits: int = 16
    quant_types: tuple[str, ...] = ()  # the 4-bit formats (quant.*.quant_type) it serves; empty: any
    modules: tuple[type, ...] = ()  # the module classes it builds
    output_in_input_dtype = False  # under autocast its output keeps its input's dtype (fp32 residual stream)
    pins_input = False  # its matmul keeps its input on its own autograd node, past checkpointing
    holds_dequantized = False  # accel.cache_dequantized applies to it
    fuses = False  # qft.accel.fuse can run a group of its projections as one (see fuse_kind)

    def quantize(self, linear: nn.Linear, s: dict, compute_dtype: torch.dtype, device) -> nn.Module:
        """The frozen module that replaces `linear` under settings `s`, computing in `compute_dtype` on `device`."""
        raise NotImplementedError

    def tensors(self, q: nn.Module) -> dict[str, torch.Tensor]:
        """The tensors of `q` that rebuild it without quantizing again (the quantized-base cache)."""
        out = {"weight": q.weight.data}
        if q.bias is not None:
            out["bias"] = q.bias.data
        return out

    def rebuild(self, t: dict, s: dict, in_f: int, out_f: int, compute_dtype: torch.dtype, device,
                at: str | None) -> nn.Module:
        """The module of settings `s` and shape (`in_f`, `out_f`) from `t` (what `tensors` gave), on `device`; built
        on `at` ("meta", or None: the default device, drawing the RNG as `quantize` draws it)."""
        raise NotImplementedError

    def dequantized(self, q: nn.Module) -> nn.Module:
        """`q` with its weight held dequantized in the compute dtype (accel.cache_dequantized); `q` itself here."""
        return q

    def weight(self, q: nn.Module) -> torch.Tensor:
        """The weight `q` computes with, in fp32."""
        return q.weight.data.float()

    def describe(self, q: nn.Module) -> str:
        """What `q` holds: its format (nf4, fp4, int8) or its weight's dtype name."""
        return str(q.weight.dtype).replace("torch.", "")

    def format(self, s: dict, compute_dtype: str) -> str:
        """What `describe` will say of a module built with settings `s` (for the memory model, before building)."""
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[compute_dtype]

    def module_bytes(self, q: nn.Module) -> int:
        """The bytes `q`'s frozen weight really holds, statistics included."""
        return sum(t.numel() * t.element_size() for t in list(q.parameters(recurse=False)) +
                   list(q.buffers(recurse=False)))

    def weight_bytes(self, s: dict, in_f: int, out_f: int, compute_bytes: int, bias: bool) -> int:
        """`module_bytes` in closed form from settings `s`, shape (`in_f`, `out_f`), `compute_bytes` a value and
        `bias`: the memory model plans on the meta device."""
        raise NotImplementedError

    def work_bytes(self, n: int, compute_bytes: int, device: str) -> tuple[int, int]:
        """(forward, backward) transient bytes of one call on an `n`-weight projection on `device` (a dequantized
        copy at `compute_bytes` a value)."""
        return 0, 0

    def fuse_kind(self, q: nn.Module) -> str | None:
        """How qft.accel.fuse may group `q`: "stored" (one concatenated weight, each member's a view of it),
        "computed" (the group's weight made per use by `fused_weight`) or None (run alone)."""
        return None

    def compute_dtype(self, q: nn.Module) -> torch.dtype:
        """The dtype `q`'s matmul runs in."""
        return q.weight.dtype

    def fusable(self, q: nn.Module, device: torch.device) -> bool:
        """Whether a computed weight of `q` equals what its own forward computes with, on `device`."""
        return False

    def fused_weight(self, q: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The weight `q` computes with, made in `dtype` as its own forward makes it (fuse_kind "computed")."""
        raise NotImplementedError


def register(backend: Backend) -> Backend:
    """Add `backend` to BACKENDS and return it; raises ValueError where its (bits, quant_types) overlap another's."""
    for other in BACKENDS.values():
        if other.name != backend.name and other.bits == backend.bits and (
                not other.quant_types or not backend.quant_types or set(other.quant_types) & set(backend.quant_types)):
            raise ValueError(f"backend {backend.name!r} serves what {other.name!r} serves ({backend.bits} bits)")
    BACKENDS[backend.name] = backend
    return backend


def for_settings(s: dict) -> Backend:
    """The backend serving settings `s` (bits, quant_type); raises KeyError where none does."""
    for b in BACKENDS.values():
        if b.bits == s["bits"] and (not b.quant_types or s.get("quant_type") in b.quant_types):
            return b
    raise KeyError(f"no quantization backend for bits={s['bits']} quant_type={s.get('quant_type')}")


def for_module(q: nn.Module) -> Backend | None:
    """The backend that built `q`, by exact class (a subclass of nn.Linear is not a 16-bit projection), or None."""
    for b in BACKENDS.values():
        if type(q) in b.modules:
            return b
    return None


def bits() -> list[int]:
    """The bit widths the registered backends serve, sorted."""
    return sorted({b.bits for b in BACKENDS.values()})


def quant_types() -> list[str]:
    """The 4-bit formats (quant.*.quant_type) the registered backends serve."""
    return [t for b in BACKENDS.values() for t in b.quant_types]
