"""LoRA adapters per layer type, projection and depth group, written as a stock peft LoraConfig.

peft silently ignores pattern keys that match nothing, so every generated key is an exact module name
and the wrapped model is checked module by module against the plan.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import torch
from torch import nn

from qft import layers as L, schema
from qft.errors import QftError, integer, number


FIELDS = {"r": lambda k, v: integer(k, v, 0, what="an integer >= 0 (0 = no adapter)"),
          "alpha": lambda k, v: number(k, v, above=0)}


def check(cfg, depth: int | None = None) -> None:
    """Check the adapter group `cfg` (depth groups against `depth` layers where known); raises QftError naming the
    key (adapter.<type>.r, adapter.<type>.alpha, ...)."""
    L.check_spec(cfg, "adapter", FIELDS, depth, other_keys=("dropout", "use_rslora", "dropout_mask", "shared_dropout"))
    schema.check(cfg, "adapter")
    for lt in L.LAYER_TYPES:
        for f in FIELDS:
            if cfg[lt].get(f) is None:  # check_spec made each layer type a map
                raise QftError(f"adapter.{lt}.{f}", None, "required for every layer type")


def plan(cfg, layers: list[L.Layer]) -> dict[str, dict]:
    """{projection name: {"r", "alpha"}} for each of `layers` under adapter group `cfg`, resolved as layers.resolve
    does (overlapping depth groups: later wins); rank 0 means no adapter."""
    return L.resolve(cfg, layers, FIELDS)


def count(plan_: dict[str, dict], layers: list[L.Layer], depth_groups: dict | None = None) -> dict:
    """The trainable parameters `plan_` gives `layers`, r * (d_in + d_out) per projection, from shapes alone: total,
    per layer type, projection, depth and depth group (the thirds plus `depth_groups`)."""
    by_type, by_proj, by_depth = defaultdict(int), defaultdict(int), defaultdict(int)
    groups = {**L.depth_thirds(L.num_layers(layers)), **(depth_groups or {})}
    by_group = {g: 0 for g in groups}
    for layer in layers:
        n = plan_[layer.name]["r"] * (layer.in_features + layer.out_features)
        by_type[layer.layer_type] += n
        by_proj[layer.proj] += n
        by_depth[layer.depth] += n
        for g, (lo, hi) in groups.items():
            if lo <= layer.depth <= hi:
                by_group[g] += n
    return {"total": sum(by_type.values()), "per_layer_type": {lt: by_type[lt] for lt in L.LAYER_TYPES},
            "per_projection": dict(by_proj), "per_depth_group": by_group,
            "per_depth": [by_depth[d] for d in range(L.num_layers(layers))]}


def lora_config(cfg, plan_: dict[str, dict]):
    """A stock peft LoraConfig giving each module of `plan_` its rank and alpha, with `cfg`'s dropout and rsLoRA.

    Raises QftError (adapter) where every rank is 0. Exact module names: peft ignores patterns that match nothing."""
    from peft import LoraConfig

    targets = {n: s for n, s in plan_.items() if s["r"] > 0}
    if not targets:
        raise QftError("adapter", "all ranks 0", "at least one projection needs rank > 0")
    r = Counter(s["r"] for s in targets.values()).most_common(1)[0][0]
    alpha = Counter(s["alpha"] for s in targets.values()).most_common(1)[0][0]
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=float(cfg.dropout), use_rslora=bool(cfg.use_rslora), bias="none",
        task_type="CAUSAL_LM",
        target_modules="|".join(re.escape(n) for n in targets),  # a string is full-matched by peft
        rank_pattern={re.escape(n): s["r"] for n, s in targets.items() if s["r"] != r},
        alpha_pattern={re.escape(n): s["alpha"] for n, s in targets.items() if s["alpha"] != alpha},
    )


def attach(model: nn.Module, cfg, layers: list[L.Layer], shared_input: tuple = L.Architecture().shared_input):
    """(the peft-wrapped `model`, its plan) with adapters per adapter group `cfg` on `layers`, checked module by
    module (verify); an all-zero plan leaves `model` unwrapped (a sweep's zero-budget point).

    `shared_input`: the projection groups that read one input, which adapter.shared_dropout shares a mask across."""
    from peft import get_peft_model

    plan_ = plan(cfg, layers)
    if not any(s["r"] for s in plan_.values()):
        return model, plan_
    mark_quantized(model)
    peft_model = get_peft_model(model, lora_config(cfg, plan_))
    verify(peft_model, plan_, bool(cfg.use_rslora))
    if cfg.dropout_mask == "fast" and cfg.dropout > 0:
        for module in peft_model.modules():
            if isinstance(getattr(module, "lora_dropout", None), nn.ModuleDict):
                for key in module.lora_dropout:
                    module.lora_dropout[key] = FastDropout(cfg.dropout)
    if cfg.shared_dropout and cfg.dropout > 0:
        share_dropout(peft_model, layers, shared_input)
    return peft_model, plan_


class SharedDropout(nn.Module):
    """Dropout module `inner` shared through `cache` by the projections that read one input (adapter.shared_dropout):
    the first member called with a tensor draws the mask, the others reuse the dropped input; a new tensor draws again.

    Another model of dropout than peft's, hence opt-in and hashed; it saves the group's other masks."""

    def __init__(self, inner: nn.Module, cache: dict):
        super().__init__()
        self.inner, self.cache = inner, cache

    def forward(self, x):
        if not self.training:
            return self.inner(x)
        c = self.cache
        if c.get("x") is not x or c.get("version") != x._version:
            c.update(x=x, version=x._version, dropped=self.inner(x), uses=0, draws=c.get("draws", 0) + 1)
        dropped = c["dropped"]
        c["uses"] += 1
        if c["uses"] == c["members"]:  # the last member has it: hold it no longer than peft would
            c.update(x=None, dropped=None)
        return dropped

    def extra_repr(self) -> str:
        return "mask shared by its group"


def share_dropout(model: nn.Module, layers: list[L.Layer], shared_input: tuple) -> None:
    """Give each group of `shared_input` projections of `layers` in peft `model` one SharedDropout, in place."""
    base = model.get_base_model()
    by_parent = defaultdict(dict)
    for layer in layers:
        by_parent[layer.name.rpartition(".")[0]][layer.proj] = base.get_submodule(layer.name)
    for projs in by_parent.values():
        for names in shared_input:
            members = [projs[n] for n in names if n in projs and "default" in getattr(projs[n], "lora_dropout", {})]
            cache: dict = {"members": len(members)}
            for m in members:
                m.lora_dropout["default"] = SharedDropout(m.lora_dropout["default"], cache)


def mark_quantized(model: nn.Module) -> None:
    """Set `is_loaded_in_4bit` / `is_loaded_in_8bit` on `model` where it holds such bitsandbytes layers.

    peft's dispatch reads them to wrap each in its bnb LoRA class, as the stock path does (merge_and_unload works)."""
    import bitsandbytes as bnb

    kinds = {type(m) for m in model.modules()}
    model.is_loaded_in_4bit = any(issubclass(k, bnb.nn.Linear4bit) for k in kinds)
    model.is_loaded_in_8bit = any(issubclass(k, bnb.nn.Linear8bitLt) for k in kinds)


class _MaskedScale(torch.autograd.Function):
    """x * keep * `scale` with keep = lanes >= threshold, saving only the 1-byte mask for backward.

    `compiled` (accel.compiled_masks): one pass of qft.accel.kernels, same bits; with `cast` (one matmul reads it
    under bf16 autocast) the output is already autocast's bf16 copy. Not with shared dropout: autograd would then
    sum the gradients in bf16."""

    @staticmethod
    def forward(ctx, x, lanes, threshold, scale, compiled, cast):
        ctx.scale = scale
        ctx.compiled = compiled and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
        if ctx.compiled:
            from qft.accel import kernels

            cast = cast and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            out = torch.empty(x.shape, dtype=torch.bfloat16 if cast else torch.float32)
            keep = torch.empty(x.shape, dtype=torch.bool)
            kernels.drop(x, lanes, threshold, scale, out, keep)
        else:
            keep = lanes >= threshold
            out = _masked(x, keep, scale)
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        if ctx.compiled and grad.dtype in (torch.float32, torch.bfloat16):
            from qft.accel import kernels

            grad, out = grad.contiguous(), torch.empty(grad.shape, dtype=torch.float32)
            kernels.undrop(grad, keep, ctx.scale, out)
            return out, None, None, None, None, None
        return _masked(grad, keep, ctx.scale), None, None, None, None, None


def _masked(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """(x * keep) * scale, contiguous, with the bool `keep` read as uint8 bytes: the same bits, and a vectorized cast
    where a bool multiply promotes element by element."""
    return keep.view(torch.uint8).to(x.dtype).mul_(x).mul_(scale)


class FastDropout(nn.Module):
    """Inverted dropout with probability `p` (rounded to a multiple of 1/65536), its mask from 16 random bits an
    element drawn 64 at a time.

    Raw draws are far cheaper than torch's Bernoulli masks on a CPU (benchmarks/README.md); another random stream,
    so adapter.dropout_mask=fast is hashed."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.threshold = round(p * 65536) - 32768  # an int16 lane below this drops its element
        self.scale = 65536 / (65536 - round(p * 65536))
        self.compiled = False  # compile_masks: one compiled pass instead of torch's ops, the same bits
        self.one_reader = True  # its output feeds one matmul (not a group's shared dropout): it may cast for autocast

    def forward(self, x):
        if not self.training or self.threshold == -32768:
            return x
        n = x.numel()
        bits = draws((n + 3) // 4, x.device, self.compiled)
        return _MaskedScale.apply(x, bits.view(torch.int16)[:n].view(x.shape), self.threshold, self.scale,
                                  self.compiled, self.one_reader)

    def extra_repr(self) -> str:
        return f"p={self.p}, mask=fast" + (", compiled" if self.compiled else "")


def draws(n: int, device: torch.device, compiled: bool) -> torch.Tensor:
    """`n` raw 64-bit draws (int64) from torch's generator for `device`; `compiled`: on a CPU the same draws made on
    every thread by qft.accel.kernels where it can promise them."""
    bits = None
    if compiled and device.type == "cpu":
        from qft.accel import kernels

        bits = kernels.random_bits(n)
    return torch.empty(n, dtype=torch.int64, device=device).random_(-2**63, None) if bits is None else bits


def verify(peft_model, plan_: dict[str, dict], use_rslora: bool) -> None:
    """Raise RuntimeError unless every module of `peft_model` carries exactly the rank and scaling of `plan_` (alpha/r,
    or alpha/sqrt(r) with `use_rslora`) and nothing else is trainable."""
    base = peft_model.get_base_model()
    for name, s in plan_.items():
        module = base.get_submodule(name)
        lora_a = getattr(module, "lora_A", None)
        if s["r"] == 0:
            if lora_a is not None and len(lora_a):
                raise RuntimeError(f"{name}: planned rank 0 but peft attached an adapter")
            continue
        if lora_a is None or "default" not in lora_a:
            raise RuntimeError(f"{name}: planned rank {s['r']} but peft attached no adapter")
        r = lora_a["default"].out_features
        scale = s["alpha"] / (math.sqrt(s["r"]) if use_rslora else s["r"])
        if r != s["r"] or not math.isclose(module.scaling["default"], scale, rel_tol=1e-6):
            raise RuntimeError(f"{name}: planned r={s['r']} scale={scale}, got r={r} scale={module.scaling['default']}")
    expected = sum(s["r"] * (base.get_submodule(n).in_features + base.get_submodule(n).out_features)
                   for n, s in plan_.items())
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    if trainable != expected:
        raise RuntimeError(f"trainable parameters {trainable} != planned {expected}")
