"""Ranks that meet a budget: the config check, the solve by budget.method (shares, uniform, fitted) and the ranks
written into the adapter config, so that a run trains exactly what the budget allows."""

from __future__ import annotations

import itertools

from qft import layers as L, schema
from qft.budget.costs import cost_per_rank, uniform
from qft.budget.fitted import fit_records, propose
from qft.errors import QftError, integers, listing, number

SPLITS = schema.allowed("budget.split")
METHODS = schema.allowed("budget.method")


def check(cfg) -> None:
    """Check the budget group `cfg`: budget.grid always, and while budget.params is set its split, tolerance,
    method, and shares (method shares) or max_rank and records (method fitted); returns None, raises QftError
    naming the first bad key. Why: a bad budget fails before any weight is read."""
    integers("budget.grid", cfg.grid, 0, "a list of ranks (integers >= 0)")
    if cfg.params is None:
        return
    number("budget.params", cfg.params, above=0, what="a number of trainable parameters > 0, or null")
    schema.check(cfg, "budget", only=("split", "tolerance", "method"))  # read only while a budget is set
    method = cfg.method
    if method == "shares":
        n = len(L.LAYER_TYPES) if cfg.split == "type" else 3
        listing("budget.shares", cfg.shares, f"a list of {n} non-negative weights")
        shares = list(cfg.shares)
        if len(shares) != n or any(not isinstance(s, (int, float)) or s < 0 for s in shares) or sum(shares) <= 0:
            raise QftError("budget.shares", shares, f"{n} non-negative weights, one per "
                           + ("layer type (attn, mlp)" if cfg.split == "type" else "depth third (shallow, middle, deep)"))
    if method == "fitted":
        if cfg.split != "type":
            raise QftError("budget.split", cfg.split, "budget.method=fitted allocates per layer type: use budget.split=type")
        schema.check(cfg, "budget", only=("max_rank",))
        fit_records(cfg)  # a bad folder, dataset choice or too few cells fails here, before any weight is read


def solve(layers: list[L.Layer], cfg) -> dict[str, int]:
    """Integer ranks per group of `layers` that meet the budget group `cfg` within cfg.tolerance, by cfg.method:
    `shares` (solve_shares), `uniform` or `fitted` (the allocation fitted.propose predicts best). Raises QftError on
    budget.params where none meets it, and as fitted.fit_records."""
    method = cfg.method
    if method == "uniform":
        u = uniform(layers, cfg.params, cfg.split)
        if abs(u["off_by"]) > cfg.tolerance:
            step = sum(cost_per_rank(layers, cfg.split).values())
            raise QftError("budget.params", cfg.params,
                           f"the nearest uniform allocation (rank {u['r']} on every group) has {u['params']:,} parameters "
                           f"({u['off_by']:+.2%}), outside budget.tolerance={cfg.tolerance:g}; the nearest budgets it "
                           "meets exactly: " + " and ".join(f"{r * step:,} (rank {r})" for r in
                                                           sorted({max(1, int(cfg.params // step)), int(cfg.params // step) + 1})))
        return {g: u["r"] for g in cost_per_rank(layers, cfg.split)}
    if method == "fitted":
        f = fit_records(cfg)
        best = propose(f, layers, cfg.params, cfg.tolerance, cfg.max_rank).best
        return {lt: best[lt] for lt in L.LAYER_TYPES}
    return solve_shares(layers, cfg)


def solve_shares(layers: list[L.Layer], cfg) -> dict[str, int]:
    """Integer ranks per group of `layers` whose exact total lies within cfg.tolerance of cfg.params (`cfg` the
    budget group) and whose split between groups is nearest cfg.shares (ties: nearest the budget); raises QftError
    on budget.params where none does."""
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
    """Write the ranks `solve` finds for `layers` into the adapter config of `cfg` (a run's whole config) in place,
    per layer type or as budget_* depth groups, and return them; raises QftError as `solve`."""
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
