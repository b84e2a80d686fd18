"""`python -m qft.budget`: a budget's per-rank costs, the allocations on the rank grid, and with
budget.method=fitted the fit and its proposal; a bad setting is one `qft.budget: error:` line and exit 2.

It chooses budget=shares unless the overrides choose a budget preset (budget=uniform, budget=fitted):
    python -m qft.budget model=llama2_7b budget.params=4e6
"""

from __future__ import annotations

import sys

from qft.budget.bits import bits_records
from qft.budget.costs import allocations, cost_per_rank, meta_layers
from qft.budget.fitted import fit_records, propose
from qft.budget.ranks import check, solve
from qft.errors import QftError, fail


def overrides(argv) -> list[str]:
    """The overrides `argv` with budget=shares first unless one of them chooses a budget preset (budget=uniform,
    budget=fitted), so the command plans by shares unless told otherwise."""
    chosen = any(a.split("=")[0] in ("budget", "+budget", "~budget") for a in argv)
    return list(argv) if chosen else ["budget=shares", *argv]


def main(argv=None) -> int:
    """Run `python -m qft.budget` on the overrides `argv` (default: sys.argv[1:]): print the costs per unit of rank and
    the allocations, or with budget.method=fitted the fit and its proposal (and the bits proposal with
    budget.bits_records). Returns the exit status: 0, or 2 after one `qft.budget: error:` line naming the bad key."""
    from qft import config, model

    cfg = config.compose(overrides(sys.argv[1:] if argv is None else argv), "qft.budget", __doc__)
    if cfg is None:
        return 2
    method = cfg.budget.method
    try:
        if cfg.budget.params is None:
            raise QftError("budget.params", None, "set the budget, e.g. budget.params=1000000")
        check(cfg.budget)
        layers = meta_layers(model.resolve(cfg.model, cfg.cache_dir))
        costs = cost_per_rank(layers, cfg.budget.split)
        bits = bits_records(cfg.budget) if cfg.budget.bits_records else None
        if method == "fitted":
            f = fit_records(cfg.budget)
            proposal = propose(f, layers, cfg.budget.params, cfg.budget.tolerance, cfg.budget.max_rank)
        else:
            found = allocations(layers, cfg.budget.params, cfg.budget.split, cfg.budget.tolerance, list(cfg.budget.grid))
            if method == "uniform":
                ranks = solve(layers, cfg.budget)
            elif not found:
                raise QftError("budget.params", cfg.budget.params,
                               f"no allocation on the rank grid {list(cfg.budget.grid)} within {cfg.budget.tolerance:.0%}; "
                               f"the smallest is {min(costs.values()):,} parameters")
    except QftError as e:
        return fail("qft.budget", e)
    print(f"{cfg.model.name}: {len(layers)} projections; parameters per unit of rank: "
          + ", ".join(f"{g} {c:,}" for g, c in costs.items()))
    if method == "fitted":
        print(f.describe())
        if f.model and f.model != cfg.model.name:
            print(f"note: the records come from model {f.model}; this plan is for {cfg.model.name}")
        print(proposal.describe())
        if bits:
            print(bits.describe())
        return 0
    print(f"allocations within {cfg.budget.tolerance:.0%} of {cfg.budget.params:,.0f} trainable parameters:")
    print("| " + " | ".join(f"r_{g}" for g in costs) + " | params | off by |")
    print("|" + "---|" * (len(costs) + 2))
    for a in found:
        print("| " + " | ".join(str(a[g]) for g in costs) + f" | {a['params']:,} | {a['off_by']:+.2%} |")
    if method == "uniform":
        total = sum(ranks[g] * c for g, c in costs.items())
        print(f"uniform (budget.method=uniform): rank {next(iter(ranks.values()))} on every group, {total:,} parameters "
              f"({(total - cfg.budget.params) / cfg.budget.params:+.2%})")
    if bits:
        print(bits.describe())
    return 0
