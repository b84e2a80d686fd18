"""Quantize the frozen base per layer type: 4-bit NF4/FP4, 8-bit LLM.int8, or 16-bit in the compute dtype.

transformers' BitsAndBytesConfig applies one precision to the whole model, so mixed bits (attention at 8,
MLP at 4) are done here by swapping each projection for a bitsandbytes module. Embeddings, norms and the
LM head are left in fp32.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from qft import layers as L
from qft.errors import QftError, boolean, number, one_of
from qft.model import COMPUTE_DTYPES, compute_dtype as dtype_of

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


FIELDS = {
    "bits": lambda k, v: one_of(k, v, (4, 8, 16)),
    "quant_type": lambda k, v: one_of(k, v, ("nf4", "fp4")),
    "double_quant": boolean,
    "block_size": lambda k, v: one_of(k, v, BLOCK_SIZES),
    "threshold": lambda k, v: number(k, v, at_least=0),
}
DEFAULTS = {"bits": 4, "quant_type": "nf4", "double_quant": True, "block_size": 64, "threshold": 6.0}


def check(cfg, depth: int | None = None) -> None:
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise QftError("quant.compute_dtype", cfg.compute_dtype, f"allowed: {', '.join(COMPUTE_DTYPES)}")
    for key in ("cache_dequantized", "cache_quantized"):
        boolean(f"quant.{key}", cfg.get(key, False))
    L.check_spec(cfg, "quant", FIELDS, depth, other_keys=("compute_dtype", "cache_dequantized", "cache_quantized"))


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


def dequantized_weight(q: nn.Module) -> torch.Tensor:
    """The weight a quantized projection computes with, in fp32: the 4-bit codes or the int8 rows times their scale."""
    import bitsandbytes.functional as bf

    kind = type(q).__name__
    if kind == "Linear4bit":
        return bf.dequantize_4bit(q.weight.data, q.weight.quant_state).float()
    if kind == "Linear8bitLt":  # after a first forward bitsandbytes keeps the row scales in the module's state
        scb = q.weight.SCB if getattr(q.weight, "SCB", None) is not None else q.state.SCB
        return q.weight.data.float() * scb.float()[:, None] / 127
    return q.weight.data.float()


def dequantize(model: nn.Module) -> nn.Module:
    """Replace every bitsandbytes projection (and Dequantized one) of an unwrapped model by an fp32 nn.Linear holding
    exactly the weight it computed with: the base to merge a trained adapter into for deployment
    (`PeftModel.from_pretrained(dequantize(base), adapter).merge_and_unload()`); merging into the 4-bit base itself
    re-quantizes the sum, which loses most of a small adapter."""
    for name, module in list(model.named_modules()):
        if type(module).__name__ in ("Linear4bit", "Linear8bitLt", "Dequantized"):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device="meta")
            linear.weight = nn.Parameter(dequantized_weight(module), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.data.float(), requires_grad=False)
            model.set_submodule(name, linear)
    return model


def _tensors(q: nn.Module) -> dict[str, torch.Tensor]:
    """What rebuilds a quantized projection without quantizing it again."""
    out = {"weight": q.weight.data}
    if type(q).__name__ == "Linear4bit":
        out.update({f"qs.{k}": v for k, v in q.weight.quant_state.as_dict(packed=True).items()})
    elif type(q).__name__ == "Linear8bitLt":
        out["SCB"] = q.weight.SCB
    elif isinstance(q, Dequantized):
        out["quantized_bytes"] = torch.tensor([q.quantized_bytes])
    if q.bias is not None:
        out["bias"] = q.bias.data
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _rebuilt(t: dict, s: dict, in_f: int, out_f: int, compute_dtype: torch.dtype, device, draw: bool) -> nn.Module:
    """With `draw`, the modules are built as _quantized builds them (nn.Linear's random init, then replaced),
    so the global RNG, and with it the seeded LoRA init that follows, is the same as without the cache;
    without, they are built on the meta device and the caller restores the RNG state those draws end in."""
    import bitsandbytes as bnb

    bias = "bias" in t
    at = None if draw else "meta"
    if "quantized_bytes" in t:
        if draw:
            nn.Linear(in_f, out_f, bias=bias)  # the draws of the Linear4bit the dequantized copy came from
        q = Dequantized.__new__(Dequantized)
        nn.Module.__init__(q)
        q.in_features, q.out_features, q.quant_type = in_f, out_f, s["quant_type"]
        q.quantized_bytes = int(t["quantized_bytes"].item())
        q.weight = nn.Parameter(t["weight"], requires_grad=False)
        q.bias = nn.Parameter(t["bias"], requires_grad=False) if bias else None
        return q.to(device)
    if s["bits"] == 4:
        q = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=compute_dtype,
                              compress_statistics=s["double_quant"], quant_type=s["quant_type"],
                              quant_storage=torch.uint8, device=at)
        stats = {k[3:]: v for k, v in t.items() if k.startswith("qs.")}
        q.weight = bnb.nn.Params4bit.from_prequantized(t["weight"], stats, requires_grad=False, device=device,
                                                       module=q)
        q.support_avx512bf16_for_cpu = False
    elif s["bits"] == 8:
        q = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias, has_fp16_weights=False, threshold=float(s["threshold"]),
                                device=at)
        q.weight = bnb.nn.Int8Params(t["weight"].to(device), requires_grad=False, has_fp16_weights=False)
        q.weight.CB, q.weight.SCB = q.weight.data, t["SCB"].to(device)
    else:
        q = nn.Linear(in_f, out_f, bias=bias, dtype=compute_dtype, device=at)
        q.weight = nn.Parameter(t["weight"].to(device), requires_grad=False)
    if bias:
        q.bias = nn.Parameter(t["bias"].to(device), requires_grad=False)
    return q


def quantize(model: nn.Module, cfg, layers: list[L.Layer], device: torch.device,
             cache: Path | None = None) -> dict[str, dict]:
    """Swap every projection in place and move the model to `device`; return each projection's settings.

    With `cache` (a file named by the model's fingerprint and these settings), the quantized tensors are
    stored once and later runs rebuild the modules from them: bitsandbytes' CPU quantization is most of a
    sweep run's start-up, and it is deterministic, so the rebuilt base is the same tensors.
    """
    from safetensors.torch import load_file

    compute_dtype = dtype_of(cfg.compute_dtype, device)
    settings = plan(cfg, layers)
    dequantize = cfg.get("cache_dequantized", False)
    stored = load_file(str(cache)) if cache is not None and cache.exists() else None
    # the RNG state the module inits end in, for this RNG state before them: restoring it skips the draws
    before = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    rng_file = cache.with_name(f"{cache.stem}.rng-{before}.safetensors") if cache is not None else None
    after = load_file(str(rng_file))["rng"] if stored is not None and rng_file.exists() else None
    keep = {}
    for layer in layers:
        parent_name, _, child = layer.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        s = settings[layer.name]
        if stored is not None:
            t = {k[len(layer.name) + 1:]: v for k, v in stored.items() if k.startswith(layer.name + ".")}
            q = _rebuilt(t, s, layer.in_features, layer.out_features, compute_dtype, device, draw=after is None)
        else:
            q = _quantized(getattr(parent, child), s, compute_dtype, device)
            q = Dequantized(q) if dequantize and s["bits"] == 4 else q
            if cache is not None:
                keep.update({f"{layer.name}.{k}": v for k, v in _tensors(q).items()})
        setattr(parent, child, q)
    model.to(device)
    if after is not None:
        torch.set_rng_state(after)
    elif cache is not None:
        _atomic_save({"rng": torch.get_rng_state()}, rng_file)
    if keep:
        _atomic_save(keep, cache)
    return settings


def _atomic_save(tensors: dict, path: Path) -> None:
    """Temp file + rename: parallel sweep jobs may fill the same entry."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def cache_file(cfg, layers: list[L.Layer], fingerprint: str, device: torch.device, cache_dir) -> Path:
    """Where a base quantized with these settings is kept: named by the model and every setting that
    changes the quantized tensors (and the bitsandbytes version that made them)."""
    import json
    from importlib.metadata import version

    key = json.dumps({"model": fingerprint, "plan": plan(cfg, layers), "dtype": str(dtype_of(cfg.compute_dtype, device)),
                      "dequantized": bool(cfg.get("cache_dequantized", False)), "device": device.type,
                      "bitsandbytes": version("bitsandbytes")}, sort_keys=True)
    return Path(cache_dir).expanduser() / "quantized" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


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
