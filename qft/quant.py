"""Quantize the frozen base per layer type: 4-bit NF4/FP4, 8-bit LLM.int8, or 16-bit in the compute dtype.

transformers' BitsAndBytesConfig applies one precision to the whole model, so mixed bits (attention at 8,
MLP at 4) are done here by swapping each projection for a bitsandbytes module. Embeddings, norms and the
LM head are left in fp32.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from qft import layers as L
from qft.errors import QftError
from qft.model import COMPUTE_DTYPES, compute_dtype as dtype_of

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


def _one_of(allowed):
    def check(key, value):
        if value not in allowed:
            raise QftError(key, value, f"allowed: {', '.join(map(str, allowed))}")
    return check


def _positive(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise QftError(key, value, "a number >= 0")


FIELDS = {
    "bits": _one_of((4, 8, 16)),
    "quant_type": _one_of(("nf4", "fp4")),
    "double_quant": _one_of((True, False)),
    "block_size": _one_of(BLOCK_SIZES),
    "threshold": _positive,
}
DEFAULTS = {"bits": 4, "quant_type": "nf4", "double_quant": True, "block_size": 64, "threshold": 6.0}


def check(cfg, depth: int | None = None) -> None:
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise QftError("quant.compute_dtype", cfg.compute_dtype, f"allowed: {', '.join(COMPUTE_DTYPES)}")
    if cfg.get("cache_dequantized", False) not in (True, False):
        raise QftError("quant.cache_dequantized", cfg.cache_dequantized, "true or false")
    L.check_spec(cfg, "quant", FIELDS, depth, other_keys=("compute_dtype", "cache_dequantized"))


def plan(cfg, layers: list[L.Layer]) -> dict[str, dict]:
    """The full quantization settings of every projection."""
    return {name: {**DEFAULTS, **s} for name, s in L.resolve(cfg, layers, FIELDS).items()}


def _quantized(linear: nn.Linear, s: dict, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    w = linear.weight.data
    if s["bits"] == 16:
        q = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=compute_dtype)
        q.weight = nn.Parameter(w.to(compute_dtype), requires_grad=False)
    elif s["bits"] == 8:
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=float(s["threshold"]))
        q.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=s["double_quant"],
                              quant_type=s["quant_type"], quant_storage=torch.uint8)
        q.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type=s["quant_type"],
                                     compress_statistics=s["double_quant"], blocksize=s["block_size"])
        # On AVX512-BF16 CPUs bitsandbytes repacks the weight in place at the first no-grad forward, so
        # evaluation would change the tensors training then runs on; one layout keeps eval and train alike.
        q.support_avx512bf16_for_cpu = False
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.to(compute_dtype if s["bits"] == 16 else torch.float32),
                              requires_grad=False)
    return q.to(device)  # bitsandbytes quantizes on the move to a device


class Dequantized(nn.Linear):
    """A frozen 4-bit projection dequantized once, in the compute dtype.

    bitsandbytes dequantizes a 4-bit weight to the compute dtype in every forward and again in every
    backward, and then runs a plain matmul; the weight never changes in QLoRA, so doing it once gives the
    same numbers without the per-step cost, at 2 bytes a weight instead of about 0.5. The weight holds the
    quantized values exactly (dequantized from the 4-bit codes), so the model is still the QLoRA model.
    """

    def __init__(self, q: nn.Module):
        import bitsandbytes.functional as bf

        w = q.weight
        nn.Module.__init__(self)  # not nn.Linear's: its random init would shift the seeded LoRA init
        self.in_features, self.out_features = q.in_features, q.out_features
        self.weight = nn.Parameter(bf.dequantize_4bit(w.data, w.quant_state).to(q.compute_dtype),
                                   requires_grad=False)
        self.bias = None if q.bias is None else nn.Parameter(q.bias.data.to(q.compute_dtype), requires_grad=False)
        self.quant_type = w.quant_type
        self.quantized_bytes = module_bytes(q)  # what the frozen base is, for records and memory plans

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def quantize(model: nn.Module, cfg, layers: list[L.Layer], device: torch.device) -> dict[str, dict]:
    """Swap every projection in place and move the model to `device`; return each projection's settings."""
    compute_dtype = dtype_of(cfg.compute_dtype, device)
    settings = plan(cfg, layers)
    cache = cfg.get("cache_dequantized", False)
    for layer in layers:
        parent_name, _, child = layer.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        q = _quantized(getattr(parent, child), settings[layer.name], compute_dtype, device)
        setattr(parent, child, Dequantized(q) if cache and settings[layer.name]["bits"] == 4 else q)
    model.to(device)
    return settings


def module_bytes(module: nn.Module) -> int:
    """Bytes a projection's frozen weight really holds, quantization statistics included."""
    if hasattr(module, "quantized_bytes"):
        return module.quantized_bytes
    total = sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
    total += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
    qs = getattr(module.weight, "quant_state", None)  # 4-bit: absmax (+ nested absmax, code, offset)
    if qs is not None:
        for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
            total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if qs.state2 is not None:
            total += sum(t.numel() * t.element_size() for t in (qs.state2.absmax, qs.state2.code))
    scb = getattr(module.weight, "SCB", None)  # 8-bit: one fp32 scale per row
    if isinstance(scb, torch.Tensor):
        total += scb.numel() * scb.element_size()
    return total


def base_bytes(model: nn.Module, layers: list[L.Layer]) -> dict[str, int]:
    """Bytes of the frozen base per layer type, plus `other` (embeddings, norms, head) and `total`."""
    out = defaultdict(int)
    seen = set()
    for layer in layers:
        module = model.get_submodule(layer.name)
        out[layer.layer_type] += module_bytes(module)
        seen.update(id(t) for t in module.parameters(recurse=False))
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:  # tied embedding/head counted once
            seen.add(id(t))
            out["other"] += t.numel() * t.element_size()
    out["total"] = sum(v for k, v in out.items())
    return dict(out)


def describe(module: nn.Module) -> str:
    """`nf4`, `fp4`, `int8` or the dtype of a plain linear: what a test checks after mixed quantization."""
    name = type(module).__name__
    if name == "Linear4bit":
        return module.weight.quant_type
    if name == "Dequantized":
        return module.quant_type
    if name == "Linear8bitLt":
        return "int8"
    return str(module.weight.dtype).replace("torch.", "")
