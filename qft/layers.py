"""Which weights of a decoder are attention or MLP projections, at which depth: the architecture registry.

The registry is the one place that knows module names: per `model_type`, each projection's layer type. Every
weight matrix in a decoder layer must be one, or classification fails: a model is never half-adapted. Fused
projections (Phi-3) and 3-D expert weights (Mixtral) are refused by name, as they cannot take a rank and bits per
projection.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from qft.errors import QftError, listing, mapping

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Architecture:
    """A decoder qft serves: its projections per layer type, the groups of them that read one input (qft.accel.fuse
    runs each as one), and whether qft.pipeline can cut it into stages (embed -> layers -> norm -> head)."""

    attn: tuple[str, ...] = _ATTN
    mlp: tuple[str, ...] = _MLP
    pipeline: bool = False
    shared_input: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    def types(self) -> dict[str, tuple[str, ...]]:
        return {"attn": self.attn, "mlp": self.mlp}


REGISTRY: dict[str, Architecture] = {
    "llama": Architecture(pipeline=True), "mistral": Architecture(pipeline=True),
    "qwen2": Architecture(pipeline=True), "qwen3": Architecture(pipeline=True),
    "gemma": Architecture(), "gemma2": Architecture(), "gemma3_text": Architecture(), "olmo2": Architecture(),
}
REFUSED = {
    "phi3": "its attention and MLP are fused (qkv_proj, gate_up_proj), so q/k/v and gate/up cannot take a rank or "
            "bits of their own",
    "mixtral": "its MLP is a mixture of experts held as 3-D parameters, which bitsandbytes cannot quantize per "
               "layer type and peft reaches only through target_parameters",
}
ARCHITECTURES = {name: a.types() for name, a in REGISTRY.items()}  # model_type -> layer type -> projections
LAYER_TYPES = ("attn", "mlp")
PROJECTIONS = {proj: lt for lt, projs in Architecture().types().items() for proj in projs}

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")
_IN_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def architecture(model_type: str) -> Architecture:
    """The registry's Architecture of `model_type`; raises QftError (model.model_type) where it is refused or
    unknown."""
    if model_type in REFUSED:
        raise QftError("model.model_type", model_type, f"refused: {REFUSED[model_type]}; served: "
                                                       f"{', '.join(sorted(REGISTRY))}")
    if model_type not in REGISTRY:
        raise QftError("model.model_type", model_type, f"not in the architecture registry (served: "
                                                       f"{', '.join(sorted(REGISTRY))})")
    return REGISTRY[model_type]


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
    """Whether `module` is a linear layer, plain or bitsandbytes'."""
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def classify(model: nn.Module, model_type: str) -> list[Layer]:
    """The Layer of every attention and MLP projection of `model`, in module order, per the registry entry of
    `model_type`; raises QftError on any other weight matrix inside a decoder layer."""
    linear = [(n, m) for n, m in model.named_modules() if _is_linear(m)]
    found = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in linear})
    if model_type not in REGISTRY:
        try:
            architecture(model_type)
        except QftError as e:
            raise QftError(e.key, e.value, f"{e.allowed}; linear modules found: {', '.join(found) or 'none'}") from e
    proj_type = {p: lt for lt, projs in ARCHITECTURES[model_type].items() for p in projs}
    layers, stray = [], []
    for name, module in linear:
        match = _NAME.search(name)
        if match and match.group(2) in proj_type:
            layers.append(Layer(name, proj_type[match.group(2)], match.group(2), int(match.group(1)),
                                module.in_features, module.out_features))
        elif _IN_LAYER.search(name):
            stray.append(name)
    stray += [n for n, p in model.named_parameters() if _IN_LAYER.search(n) and p.dim() >= 2
              and not any(n.startswith(name + ".") for name, _ in linear)]
    if stray:
        names = sorted({re.sub(r"[.]\d+[.]", ".*.", n) for n in stray})
        raise QftError("model.model_type", model_type,
                       "weight matrices inside the decoder layers that the registry does not classify: "
                       + ", ".join(names[:6]))
    if not layers:
        raise QftError("model.model_type", model_type,
                       f"no attention or MLP projections found; linear modules: {', '.join(found) or 'none'}")
    return layers


def num_layers(layers: list[Layer]) -> int:
    """The number of decoder layers `layers` span (deepest depth + 1)."""
    return max(layer.depth for layer in layers) + 1


def check_spec(spec, group: str, fields: dict, depth: int | None = None, other_keys: tuple = ()) -> None:
    """Check per-layer-type `spec` (attn, mlp, projections, depth_groups) of config `group` before anything loads,
    depth groups against `depth` layers where known; raises QftError naming the key.

    `fields`: each allowed setting's checker `(key, value)`; `other_keys`: the group's own settings, checked by its
    module."""
    allowed = (*LAYER_TYPES, "projections", "depth_groups", *other_keys)
    settings = f"a map of settings ({', '.join(fields)})"
    for key in spec:
        if key not in allowed:
            raise QftError(f"{group}.{key}", spec[key], f"unknown layer type or setting; allowed: {', '.join(allowed)}")
    for lt in LAYER_TYPES:  # required: a null would quietly mean the backend's or peft's defaults
        mapping(f"{group}.{lt}", spec.get(lt), settings)
    for key in ("projections", "depth_groups"):
        mapping(f"{group}.{key}", spec.get(key), f"a map of {key.replace('_', ' ')} by name", null=True)

    def check_fields(entry, key, extra=()):
        if entry is None:
            return
        mapping(key, entry, settings)
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
            raise QftError(f"{group}.projections.{proj}", entry,
                           f"unknown projection; allowed: {', '.join(PROJECTIONS)}")
        check_fields(entry, f"{group}.projections.{proj}")
    for gname, entry in (spec.get("depth_groups") or {}).items():
        key = f"{group}.depth_groups.{gname}"
        mapping(key, entry, f"a map with layers: [first, last], and types, projections or settings "
                            f"({', '.join(fields)})")
        rng = entry.get("layers")
        if isinstance(rng, str) or not isinstance(rng, Sequence) or len(rng) != 2 \
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in rng) \
                or rng[0] < 0 or rng[1] < rng[0]:
            raise QftError(f"{key}.layers", rng, "a range [first, last] of layer indices, 0 <= first <= last")
        if depth is not None and rng[1] >= depth:
            raise QftError(f"{key}.layers", list(rng), f"the model has layers 0..{depth - 1}")
        for sel, allowed in (("types", LAYER_TYPES), ("projections", tuple(PROJECTIONS))):
            listing(f"{key}.{sel}", entry.get(sel) or [], f"a list from: {', '.join(allowed)}")
            for item in entry.get(sel) or []:
                if item not in allowed:
                    raise QftError(f"{key}.{sel}", item, f"allowed: {', '.join(allowed)}")
        check_fields(entry, key, extra=("layers", "types", "projections"))


def resolve(spec, layers: list[Layer], fields) -> dict[str, dict]:
    """{module name: {field: value}} of the `fields` that `spec` sets for each of `layers`.

    Each step overrides the one before: the layer type's settings, the projection's, then every depth group covering
    the module in the order written, so where groups overlap the later one wins."""
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
    """{"shallow", "middle", "deep": (first, last) layer} thirds of a `depth`-layer stack: the default depth groups."""
    a, b = round(depth / 3), round(2 * depth / 3)
    return {"shallow": (0, a - 1), "middle": (a, b - 1), "deep": (b, depth - 1)}
