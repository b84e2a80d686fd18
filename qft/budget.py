"""Trainable-parameter budgets: exact LoRA counts from module shapes alone, and ranks that meet a budget.

The model is built on the meta device, so a 70B architecture is planned in seconds from its config with no
weights on the machine. A LoRA adapter of rank r on a d_in x d_out projection has r * (d_in + d_out)
parameters, so each layer type (or depth group) has a fixed cost per unit of rank, and a budget split
between them is solved for integer ranks.

    python -m qft.budget model=smollm2_135m budget.params=1000000
    python -m qft.budget model=local model.path=/models/Llama-2-7b budget.params=4e6 budget.split=depth
"""

from __future__ import annotations

import itertools
import sys

import torch

from qft import layers as L
from qft.errors import QftError

SPLITS = ("type", "depth")


def meta_layers(source) -> list[L.Layer]:
    """The projections of an architecture, from its config alone (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config)
    return L.classify(model, source.model_type)


def groups(layers: list[L.Layer], split: str) -> dict[str, list[L.Layer]]:
    if split == "type":
        return {lt: [l for l in layers if l.layer_type == lt] for lt in L.LAYER_TYPES}
    thirds = L.depth_thirds(L.num_layers(layers))
    return {g: [l for l in layers if lo <= l.depth <= hi] for g, (lo, hi) in thirds.items()}


def cost_per_rank(layers: list[L.Layer], split: str) -> dict[str, int]:
    """Trainable parameters added by one unit of rank on every projection of each group."""
    return {g: sum(l.in_features + l.out_features for l in ls) for g, ls in groups(layers, split).items()}


def check(cfg) -> None:
    if cfg.params is None:
        return
    if isinstance(cfg.params, bool) or not isinstance(cfg.params, (int, float)) or cfg.params <= 0:
        raise QftError("budget.params", cfg.params, "a number of trainable parameters > 0, or null")
    if cfg.split not in SPLITS:
        raise QftError("budget.split", cfg.split, f"allowed: {', '.join(SPLITS)}")
    if not 0 < cfg.tolerance < 1:
        raise QftError("budget.tolerance", cfg.tolerance, "a fraction in (0, 1)")
    shares = list(cfg.shares)
    n = len(L.LAYER_TYPES) if cfg.split == "type" else 3
    if len(shares) != n or any(not isinstance(s, (int, float)) or s < 0 for s in shares) or sum(shares) <= 0:
        raise QftError("budget.shares", shares, f"{n} non-negative weights, one per "
                       + ("layer type (attn, mlp)" if cfg.split == "type" else "depth third (shallow, middle, deep)"))


def solve(layers: list[L.Layer], cfg) -> dict[str, int]:
    """Integer ranks per group whose exact total lies within tolerance of the budget and whose split
    between groups is nearest the requested shares (ties: nearest the budget)."""
    costs = cost_per_rank(layers, cfg.split)
    names, unit = list(costs), list(costs.values())
    shares = [float(s) / sum(cfg.shares) for s in cfg.shares]
    best, best_key = None, None
    ranges = [range(int(cfg.params * (1 + cfg.tolerance) // c) + 1) if s > 0 else range(1) for c, s in zip(unit[:-1], shares)]
    for head in itertools.product(*ranges):
        rest = cfg.params - sum(r * c for r, c in zip(head, unit))
        last = max(0, round(rest / unit[-1])) if shares[-1] > 0 else 0
        combo = (*head, last)
        total = sum(r * c for r, c in zip(combo, unit))
        if not total or abs(total - cfg.params) > cfg.tolerance * cfg.params:
            continue
        key = (sum(abs(r * c / total - s) for r, c, s in zip(combo, unit, shares)), abs(total - cfg.params))
        if best_key is None or key < best_key:
            best, best_key = combo, key
    if best is None:
        smallest = min(c for c, s in zip(unit, shares) if s > 0)
        raise QftError("budget.params", cfg.params,
                       f"no integer ranks with shares {list(cfg.shares)} come within {cfg.tolerance:.0%}; "
                       f"the smallest allocation (rank 1 on one group) is {smallest:,} parameters")
    return dict(zip(names, best))


def apply(cfg, layers: list[L.Layer]) -> dict[str, int]:
    """Set the adapter ranks of `cfg` in place from its budget; return the solved ranks."""
    from omegaconf import open_dict

    ranks = solve(layers, cfg.budget)
    with open_dict(cfg):
        if cfg.budget.split == "type":
            for lt, r in ranks.items():
                cfg.adapter[lt].r = r
        else:
            for g, (lo, hi) in L.depth_thirds(L.num_layers(layers)).items():
                cfg.adapter.depth_groups[f"budget_{g}"] = {"layers": [lo, hi], "r": ranks[g]}
    return ranks


def allocations(layers: list[L.Layer], params: float, split: str, tolerance: float, grid) -> list[dict]:
    """Every combination of grid ranks per group whose exact count lies within tolerance of the budget."""
    costs = cost_per_rank(layers, split)
    out = []
    for combo in itertools.product(grid, repeat=len(costs)):
        total = sum(r * c for r, c in zip(combo, costs.values()))
        if total and abs(total - params) <= tolerance * params:
            out.append({**dict(zip(costs, combo)), "params": total, "off_by": (total - params) / params})
    return sorted(out, key=lambda a: abs(a["off_by"]))


def main(argv=None) -> int:
    from qft import config, model

    cfg = config.compose(argv, "qft.budget")
    if cfg is None:
        return 2
    try:
        if cfg.budget.params is None:
            raise QftError("budget.params", None, "set the budget, e.g. budget.params=1000000")
        check(cfg.budget)
        layers = meta_layers(model.resolve(cfg.model, cfg.cache_dir))
        costs = cost_per_rank(layers, cfg.budget.split)
        found = allocations(layers, cfg.budget.params, cfg.budget.split, cfg.budget.tolerance, list(cfg.budget.grid))
        if not found:
            raise QftError("budget.params", cfg.budget.params,
                           f"no allocation on the rank grid {list(cfg.budget.grid)} within {cfg.budget.tolerance:.0%}; "
                           f"the smallest is {min(costs.values()):,} parameters")
    except QftError as e:
        print(f"qft.budget: error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.model.name}: {len(layers)} projections; parameters per unit of rank: "
          + ", ".join(f"{g} {c:,}" for g, c in costs.items()))
    print(f"allocations within {cfg.budget.tolerance:.0%} of {cfg.budget.params:,.0f} trainable parameters:")
    print("| " + " | ".join(f"r_{g}" for g in costs) + " | params | off by |")
    print("|" + "---|" * (len(costs) + 2))
    for a in found:
        print("| " + " | ".join(str(a[g]) for g in costs) + f" | {a['params']:,} | {a['off_by']:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
