"""What a unit of rank costs: a LoRA adapter of rank r on a d_in x d_out projection has r * (d_in + d_out)
parameters, so every budget method works from each group's cost per rank, counted on the meta device (no weights)."""

from __future__ import annotations

import itertools

import torch

from qft import layers as L


def meta_layers(source) -> list[L.Layer]:
    """The projections (qft.layers.Layer) of the architecture `source` (a resolved model: config, model_type),
    built on the meta device so that no weight is read or allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config)
    return L.classify(model, source.model_type)


def groups(layers: list[L.Layer], split: str) -> dict[str, list[L.Layer]]:
    """`layers` grouped by `split`: per layer type for "type", else per depth third (shallow, middle, deep)."""
    if split == "type":
        return {lt: [l for l in layers if l.layer_type == lt] for lt in L.LAYER_TYPES}
    thirds = L.depth_thirds(L.num_layers(layers))
    return {g: [l for l in layers if lo <= l.depth <= hi] for g, (lo, hi) in thirds.items()}


def cost_per_rank(layers: list[L.Layer], split: str) -> dict[str, int]:
    """Per group of `layers` under `split`, the trainable parameters one unit of rank adds on all its projections."""
    return {g: sum(l.in_features + l.out_features for l in ls) for g, ls in groups(layers, split).items()}


def uniform(layers: list[L.Layer], params: float, split: str = "type") -> dict:
    """The same rank r >= 1 on every group of `layers` under `split`, nearest the budget `params`, as
    {r, params, off_by}; the count is linear in r, so r rounds `params` over the summed cost per rank."""
    step = sum(cost_per_rank(layers, split).values())
    r = max(1, round(params / step))
    return {"r": r, "params": r * step, "off_by": (r * step - params) / params}


def allocations(layers: list[L.Layer], params: float, split: str, tolerance: float, grid) -> list[dict]:
    """Every combination of ranks from `grid` per group of `layers` under `split` whose exact count lies within
    `tolerance` (a fraction) of `params`: dicts of the ranks, params and off_by, nearest the budget first."""
    costs = cost_per_rank(layers, split)
    out = []
    for combo in itertools.product(grid, repeat=len(costs)):
        total = sum(r * c for r, c in zip(combo, costs.values()))
        if total and abs(total - params) <= tolerance * params:
            out.append({**dict(zip(costs, combo)), "params": total, "off_by": (total - params) / params})
    return sorted(out, key=lambda a: abs(a["off_by"]))
