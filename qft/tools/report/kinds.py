"""A declared contrast split by run kind: each kind's share of the pooled pairs, and a test of whether the contrast
depends on the kind, so a pooled verdict that one kind drives is seen, not averaged away."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from qft.tools.report.compare import Pairs, compare_configs, example_scores, pairs
from qft.tools.report.tables import table

HETEROGENEITY = "one-way ANOVA of the pairs' differences across kinds (scipy.stats.f_oneway)"


def pair_differences(ok, p: Pairs, metric: str) -> dict:
    """{seed: the pair's mean difference a - b in `metric`} over Pairs `p` of records `ok` (per-example scores where
    kept, else test accuracy)."""
    ea, eb = example_scores(p.a, metric), example_scores(p.b, metric)
    if ea and eb:
        return {s: float(np.mean(ea[s][1] - eb[s][1])) for s in p.a}
    if metric != "accuracy":
        return {}
    acc = ok.set_index("run_dir").acc_test
    return {s: float(acc[p.a[s]] - acc[p.b[s]]) for s in p.a}


def heterogeneity(groups: dict) -> dict | None:
    """{"test", "df", "F", "p"} of the one-way ANOVA over kinds of the pair differences `groups` ({kind: differences}),
    at K - 1 and S - K df: the kind x contrast interaction of the crossed model (the example effect cancels). None
    with one kind; p None where no kind has two pairs."""
    values = [v for v in groups.values() if v]
    k, s = len(values), sum(map(len, values))
    if k < 2:
        return None
    out = {"test": HETEROGENEITY, "df": [k - 1, s - k], "F": None, "p": None}
    if s > k:
        from scipy.stats import f_oneway

        with warnings.catch_warnings():  # no spread within kinds: F is infinite, scipy warns
            warnings.simplefilter("ignore")
            f, p = f_oneway(*values)
        out["F"], out["p"] = (None if f != f else float(f)), (None if p != p else float(p))
    return out


def split(ok, key_a, key_b, margin: float, metric: str) -> dict:
    """Contrast `key_a` - `key_b` of records `ok` in `metric` by run kind: per kind its pairs, mean difference and
    95% interval at `margin` (descriptive, no verdict), the heterogeneity test, and the pairs refused."""
    p = pairs(ok, key_a, key_b)
    d = pair_differences(ok, p, metric)
    rows, groups = [], {}
    for kind in sorted(set(p.kind.values())):
        seeds = sorted(s for s in p.a if p.kind[s] == kind)
        groups[kind] = [d[s] for s in seeds if s in d]
        c = compare_configs(ok, key_a, key_b, margin, metric, kind=kind, min_seeds=2)
        rows.append({"kind": kind, "seeds": [int(s) for s in seeds],
                     "diff": float(np.mean(groups[kind])) if groups[kind] else None,
                     "low": None if c is None else c.low, "high": None if c is None else c.high})
    refused = [{"seed": int(s), "a": _name(da), "kind_a": ka, "b": _name(db), "kind_b": kb}
               for s, da, ka, db, kb in p.refused]
    return {"kinds": rows, "heterogeneity": heterogeneity(groups), "refused_pairs": refused}


def _name(run_dir) -> str | None:
    """The folder name of `run_dir`, or None."""
    return None if run_dir is None else Path(str(run_dir)).name


def _number(x, fmt: str) -> str:
    """`x` in format `fmt`, or "-" for None."""
    return "-" if x is None else format(x, fmt)


def _test(het: dict | None) -> str:
    """heterogeneity() result `het` as a table cell."""
    if het is None:
        return "one kind: nothing to test"
    if het["p"] is None:
        return "not testable: no kind has two pairs" if het["F"] is None else f"F = {het['F']:.3g}, no p"
    return f"F({het['df'][0]}, {het['df'][1]}) = {_number(het['F'], '.3g')}, p {het['p']:.3g}"


def markdown(named: list[tuple[str, dict]]) -> list[str]:
    """The markdown lines of each (name, split) of `named`: one line where every pair ran on one kind, else a table
    with the heterogeneity test; then every refused pair, named."""
    kinds = sorted({r["kind"] for _, s in named if s for r in s["kinds"]})
    refused = [(n, r) for n, s in named if s for r in s["refused_pairs"]]
    if not kinds and not refused:
        return ["Run kinds: no pairs to split."]
    if len(kinds) == 1 and not refused:
        return [f"Run kinds: every pair ran on one kind ({kinds[0]}), so there is no split."]
    cells = []
    for name, s in named:
        for i, r in enumerate((s or {}).get("kinds") or [{}]):
            ci = f"[{r['low']:+.4f}, {r['high']:+.4f}]" if r.get("low") is not None else "-"
            cells.append([name if i == 0 else "", r.get("kind", "no pairs"), len(r.get("seeds", [])),
                          _number(r.get("diff"), "+.4f"), ci, _test(s["heterogeneity"]) if i == 0 and s else ""])
    lines = [f"Per run kind (the pairs of each contrast by the kind they ran on; a - b and its 95% interval from that "
             f"kind's pairs alone, an interval from 2 pairs up, descriptive, no verdict; whether the contrast differs "
             f"across kinds: {HETEROGENEITY}):", "",
             *table(["contrast", "run kind", "pairs", "a - b", "95% CI", "kinds differ?"], cells)]
    if refused:
        lines += ["", "Pairs refused, their two cells on different run kinds (left out of every analysis above):",
                  *(f"- {n}, seed {r['seed']}: {r['a']} on {r['kind_a']}; {r['b'] or '-'} on {r['kind_b']}"
                    for n, r in refused)]
    return lines
