"""Which linear modules of a decoder are attention or MLP projections, at which depth.

A small table per architecture is the single place that knows module names; quantization, adapters
and budgets all address modules through it, so a new architecture is one table row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from qft.errors import QftError

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LLAMA_LIKE = {"attn": _ATTN, "mlp": _MLP}

# model_type -> layer type -> projection names
ARCHITECTURES: dict[str, dict[str, tuple[str, ...]]] = {
    name: _LLAMA_LIKE
    for name in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3")
}
LAYER_TYPES = ("attn", "mlp")
PROJECTIONS = {proj: lt for lt, projs in _LLAMA_LIKE.items() for proj in projs}

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


@dataclass(frozen=True)
class Layer:
    """One projection: its module name, layer type, projection name, depth and shape."""

    name: str
    layer_type: str
    proj: str
    depth: int
    in_features: int
    out_features: int


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def classify(model: nn.Module, model_type: str) -> list[Layer]:
    """Every attention and MLP projection of the model, in module order."""
    table = ARCHITECTURES.get(model_type)
    linear = [(n, m) for n, m in model.named_modules() if _is_linear(m)]
    if table is None:
        found = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in linear})
        raise QftError("model.model_type", model_type,
                       f"no layer-type table for this architecture (known: {', '.join(sorted(ARCHITECTURES))}); "
                       f"linear modules found: {', '.join(found) or 'none'}")
    proj_type = {p: lt for lt, projs in table.items() for p in projs}
    layers = []
    for name, module in linear:
        match = _NAME.search(name)
        if match and match.group(2) in proj_type:
            layers.append(Layer(name, proj_type[match.group(2)], match.group(2), int(match.group(1)),
                                module.in_features, module.out_features))
    if not layers:
        found = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in linear})
        raise QftError("model.model_type", model_type,
                       f"no attention or MLP projections found; linear modules: {', '.join(found) or 'none'}")
    return layers


def num_layers(layers: list[Layer]) -> int:
    return max(layer.depth for layer in layers) + 1


def check_spec(spec, group: str, fields: dict, depth: int | None = None, other_keys: tuple = ()) -> None:
    """Check a per-layer-type spec (`attn`, `mlp`, `projections`, `depth_groups`) before anything loads.

    `fields` maps each allowed setting to a checker `(key, value) -> None` that raises QftError;
    `other_keys` are the group's own settings, checked by its module.
    """
    allowed = (*LAYER_TYPES, "projections", "depth_groups", *other_keys)
    for key in spec:
        if key not in allowed:
            raise QftError(f"{group}.{key}", spec[key], f"unknown layer type or setting; allowed: {', '.join(allowed)}")
    def check_fields(entry, key, extra=()):
        if entry is None:
            return
        for name, value in entry.items():
            if name in extra:
                continue
            if name not in fields:
                raise QftError(f"{key}.{name}", value, f"allowed settings: {', '.join(list(fields) + list(extra))}")
            fields[name](f"{key}.{name}", value)

    for lt in LAYER_TYPES:
        check_fields(spec.get(lt), f"{group}.{lt}")
    for proj, entry in (spec.get("projections") or {}).items():
        if proj not in PROJECTIONS:
            raise QftError(f"{group}.projections.{proj}", dict(entry or {}),
                           f"unknown projection; allowed: {', '.join(PROJECTIONS)}")
        check_fields(entry, f"{group}.projections.{proj}")
    for gname, entry in (spec.get("depth_groups") or {}).items():
        key = f"{group}.depth_groups.{gname}"
        rng = (entry or {}).get("layers")
        if rng is None or len(rng) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in rng) \
                or rng[0] < 0 or rng[1] < rng[0]:
            raise QftError(f"{key}.layers", rng, "a range [first, last] of layer indices, 0 <= first <= last")
        if depth is not None and rng[1] >= depth:
            raise QftError(f"{key}.layers", list(rng), f"the model has layers 0..{depth - 1}")
        for sel, allowed in (("types", LAYER_TYPES), ("projections", tuple(PROJECTIONS))):
            for item in entry.get(sel) or []:
                if item not in allowed:
                    raise QftError(f"{key}.{sel}", item, f"allowed: {', '.join(allowed)}")
        check_fields(entry, key, extra=("layers", "types", "projections"))


def resolve(spec, layers: list[Layer], fields) -> dict[str, dict]:
    """Per-module settings: layer type, then projection, then depth groups in order (later wins)."""
    out = {}
    groups = list((spec.get("depth_groups") or {}).values())
    for layer in layers:
        settings = {f: v for f, v in dict(spec.get(layer.layer_type) or {}).items() if f in fields}
        settings.update({f: v for f, v in dict((spec.get("projections") or {}).get(layer.proj) or {}).items()
                         if f in fields})
        for group in groups:
            lo, hi = group["layers"]
            if not lo <= layer.depth <= hi:
                continue
            if group.get("types") and layer.layer_type not in group["types"]:
                continue
            if group.get("projections") and layer.proj not in group["projections"]:
                continue
            settings.update({f: v for f, v in dict(group).items() if f in fields})
        out[layer.name] = settings
    return out


def depth_thirds(depth: int) -> dict[str, tuple[int, int]]:
    """Shallow / middle / deep thirds of the stack, the default depth groups of records and sweeps."""
    a, b = round(depth / 3), round(2 * depth / 3)
    return {"shallow": (0, a - 1), "middle": (a, b - 1), "deep": (b, depth - 1)}
