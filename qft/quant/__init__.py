"""Quantize the frozen base per layer type: 4-bit NF4/FP4, 8-bit LLM.int8, or 16-bit in the compute dtype.

transformers' BitsAndBytesConfig applies one precision to the whole model, so mixed bits (attention at 8,
MLP at 4) are done here by swapping each projection for the module its backend builds (bitsandbytes' own for 4
and 8 bits). Embeddings, norms and the LM head are left in fp32. Each kind is a backend (qft/quant/registry.py),
one file each in this package; every module of the package is imported with it, so a new file is a new backend.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from qft import atomic, layers as L, schema
from qft.errors import boolean, number, one_of
from qft.model import compute_dtype as dtype_of
from qft.quant import bnb4, dense, int8  # noqa: F401  (the built-in backends register themselves)
from qft.quant.bnb4 import Dequantized  # noqa: F401  (qft.quant.Dequantized, as before the split)
from qft.quant.registry import BACKENDS, Backend, bits, for_module, for_settings, quant_types, register  # noqa: F401

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


FIELDS = {
    "bits": lambda k, v: one_of(k, v, tuple(bits())),
    "quant_type": lambda k, v: one_of(k, v, tuple(quant_types())),
    "double_quant": boolean,
    "block_size": lambda k, v: one_of(k, v, BLOCK_SIZES),
    "threshold": lambda k, v: number(k, v, at_least=0),
}
DEFAULTS = {"bits": 4, "quant_type": "nf4", "double_quant": True, "block_size": 64, "threshold": 6.0}


def check(cfg, depth: int | None = None) -> None:
    """Check the quant group `cfg` (depth groups against `depth` layers where known); raises QftError naming the key."""
    schema.check(cfg, "quant")
    L.check_spec(cfg, "quant", FIELDS, depth,
                 other_keys=("compute_dtype", "attention_dtype"))


def plan(cfg, layers: list[L.Layer]) -> dict[str, dict]:
    """{projection name: full settings (DEFAULTS filled in)} for each of `layers` under quant group `cfg`, resolved
    as layers.resolve does (overlapping depth groups: later wins)."""
    return {name: {**DEFAULTS, **s} for name, s in L.resolve(cfg, layers, FIELDS).items()}


def dequantized_weight(q: nn.Module) -> torch.Tensor:
    """The weight projection `q` computes with, in fp32 (4-bit codes or int8 rows times their scales)."""
    return (for_module(q) or BACKENDS["dense"]).weight(q)


def dequantize(model: nn.Module) -> nn.Module:
    """`model` (unwrapped) with every quantized or Dequantized projection replaced, in place, by an fp32 nn.Linear
    holding exactly the weight it computed with.

    The base to merge an adapter into: merging into the 4-bit base re-quantizes the sum and loses most of it."""
    for name, module in list(model.named_modules()):
        if for_module(module) is not None and type(module) is not nn.Linear:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device="meta")
            linear.weight = nn.Parameter(dequantized_weight(module), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.data.float(), requires_grad=False)
            model.set_submodule(name, linear)
    return model


def quantize(model: nn.Module, cfg, layers: list[L.Layer], device: torch.device,
             cache: Path | None = None, dequantize: bool = False) -> dict[str, dict]:
    """Quantize each of `layers` in `model` in place per quant group `cfg`, move `model` to `device`; returns plan().

    `cache` (cache_file's path): the quantized tensors are stored once and rebuilt from there by later runs, the RNG
    left as quantizing leaves it; `dequantize` (accel.cache_dequantized): 4-bit weights held dequantized, same numbers.
    Why the cache: bitsandbytes' CPU quantization is deterministic and most of a sweep run's start-up."""
    from safetensors.torch import load_file

    compute_dtype = dtype_of(cfg.compute_dtype, device)
    settings = plan(cfg, layers)
    stored = load_file(str(cache)) if cache is not None and cache.exists() else None
    # the RNG state the module inits end in, for this RNG state before them: restoring it skips the draws
    before = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    rng_file = cache.with_name(f"{cache.stem}.rng-{before}.safetensors") if cache is not None else None
    after = load_file(str(rng_file))["rng"] if stored is not None and rng_file.exists() else None
    keep, by_layer = {}, {}
    for k, v in (stored or {}).items():  # each projection's tensors, grouped once (not a scan of all per projection)
        name, _, part = k.rpartition(".")
        while name and name not in settings:  # a tensor's own name may hold dots (quant_state.bitsandbytes__nf4)
            name, _, head = name.rpartition(".")
            part = f"{head}.{part}"
        by_layer.setdefault(name, {})[part] = v
    for layer in layers:
        parent_name, _, child = layer.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        s = settings[layer.name]
        backend = for_settings(s)
        if stored is not None:
            t = by_layer.get(layer.name, {})
            # drawing as quantize draws keeps the global RNG, and the seeded LoRA init after it, as without the
            # cache; without, the modules are built on the meta device and the RNG state they end in restored
            q = backend.rebuild(t, s, layer.in_features, layer.out_features, compute_dtype, device,
                                at=None if after is None else "meta")
        else:
            q = backend.quantize(getattr(parent, child), s, compute_dtype, device)
            q = backend.dequantized(q) if dequantize else q
            if cache is not None:
                keep.update({f"{layer.name}.{k}": v.detach().cpu().contiguous()
                             for k, v in backend.tensors(q).items()})
        setattr(parent, child, q)
    model.to(device)
    if after is not None:
        torch.set_rng_state(after)
    elif cache is not None:
        _save(rng_file, {"rng": torch.get_rng_state()})
    if keep:
        _save(cache, keep)
    return settings


def _save(path: Path, tensors: dict) -> None:
    """Write `tensors` to `path` atomically: parallel sweep jobs may fill the same entry."""
    from safetensors.torch import save_file

    atomic.write(path, lambda tmp: save_file(tensors, tmp))


def cache_file(cfg, layers: list[L.Layer], fingerprint: str, device: torch.device, cache_dir,
               dequantized: bool = False) -> Path:
    """The cache path under `cache_dir` for `layers` quantized per `cfg` on `device` (`dequantized` or not) from the
    weights of `fingerprint`: named by the hash of all that and the bitsandbytes version."""
    import json
    from importlib.metadata import version

    key = json.dumps({"model": fingerprint, "plan": plan(cfg, layers), "dtype": str(dtype_of(cfg.compute_dtype, device)),
                      "dequantized": bool(dequantized), "device": device.type,
                      "bitsandbytes": version("bitsandbytes")}, sort_keys=True)
    return Path(cache_dir).expanduser() / "quantized" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def module_bytes(module: nn.Module) -> int:
    """The bytes projection `module`'s frozen weight really holds, quantization statistics included."""
    return (for_module(module) or Backend()).module_bytes(module)


def base_bytes(model: nn.Module, layers: list[L.Layer]) -> dict[str, int]:
    """The bytes of `model`'s frozen base per layer type of `layers`, plus `other` (embeddings, norms, head; tied
    tensors once) and `total`."""
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
    """`nf4`, `fp4`, `int8`, or the weight dtype of plain linear `module`."""
    return (for_module(module) or Backend()).describe(module)


def discover() -> None:
    """Import every other module of this package: a backend added as one file registers itself."""
    import importlib
    import pkgutil

    for m in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{m.name}")


discover()
