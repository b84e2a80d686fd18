"""Configurations against each other: seeds pooled per cell (the cell key: one cell whatever kind ran it), and a
difference with its interval and verdict over pairs (a seed's two cells) of one run kind, pooled across kinds, paired
over examples where the records allow it, so a reader sees whether it beats the seed noise."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qft import stats
from qft.record import read_examples
from qft.frame import AXES, THIRDS, kind_name, one_kind

if TYPE_CHECKING:
    import pandas as pd

MARGIN = 0.02  # the default equivalence margin, in accuracy
MIN_SEEDS = 3  # seeds both trained cells need for a paired verdict (2 under-cover; 1 cannot see training noise)


def one_record_a_seed(df) -> tuple["pd.DataFrame", list[str]]:
    """(the ok records of frame `df`, one a cell and seed, the last by folder; the folders of the repeats left out)."""
    ok = df[df.status == "ok"]
    if "cell_key" not in ok:
        return ok, []
    repeat = ok.duplicated(["cell_key", "seed"], keep="last")  # a mask: records of several folders may share labels
    return ok[~repeat], sorted(Path(str(d)).name for d in ok[repeat].get("run_dir", []))


def grouped(df, versus: dict | None = None, within: tuple = (), margin: float = MARGIN) -> "pd.DataFrame":
    """A row per configuration of frame `df` (accuracy mean, sd, 95% interval), each compared at `margin` with the
    best or the one matching `versus`, within each group of `within` columns.

    Paired over seeds and examples where both sides kept per-example scores, else Welch; Holm across the table
    (exploratory). An untrained configuration is one evaluation, shown once."""
    ok = one_record_a_seed(df)[0].copy()
    keep = ["params", "params_attn", "params_mlp", *[f"params_{t}" for t in THIRDS], "adapted",
            *[a for a in AXES.values() if ok[a].notna().any()]]
    for col in [*(versus or {}), *within]:
        if col not in ok:
            raise ValueError(f"column {col!r} is not in the records; allowed: {', '.join(keep)}")
    g = ok.groupby("cell_key", sort=False)
    out = g[keep].first().join(stats.seed_summary(g))
    untrained = out.params.fillna(0) == 0
    out.loc[untrained, ["n_seeds", "acc_sd"]] = [1, 0.0]
    out["ci95"] = [stats.t_quantile(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
                   for n, sd in zip(out.n_seeds, out.acc_sd)]
    out["tokens_per_s"] = g.tokens_per_s.mean()
    if "macro_f1_test" in ok:
        out["macro_f1"] = g.macro_f1_test.mean()
    out = out.sort_values([*within, "params", "acc_mean"]).reset_index()
    out["vs_ref"], comparisons = -1, {}
    for _, part in (out.groupby(list(within), sort=False) if within else [(None, out)]):
        ref = reference(part, versus)
        for i in part.index:
            out.loc[i, "vs_ref"] = -1 if ref is None else ref
            if ref is not None and i != ref:
                comparisons[i] = compare_configs(ok, out.cell_key[i], out.cell_key[ref], margin)
    stats.holm(list(comparisons.values()))
    for col in ("vs_diff", "vs_low", "vs_high", "vs_p_adj", "vs_p_tost_adj"):
        out[col] = float("nan")
    out["vs_verdict"], out["vs_method"], out["vs_refused"] = "", "", ""
    for i, c in comparisons.items():
        refused = pairs(ok, out.cell_key[i], out.cell_key[out.vs_ref[i]]).refused
        out.loc[i, "vs_refused"] = ", ".join(f"seed {s} ({Path(str(da)).name if da else '-'} on {ka}; "
                                             f"{Path(str(db)).name if db else '-'} on {kb})"
                                             for s, da, ka, db, kb in refused)
        if c is None:
            if refused:
                out.loc[i, "vs_verdict"] = "not comparable"  # too few seeds left once pairs across kinds are out
        else:
            out.loc[i, ["vs_diff", "vs_low", "vs_high", "vs_p_adj", "vs_p_tost_adj"]] = [c.diff, c.low, c.high, c.p_adj,
                                                                                       c.p_tost_adj]
            out.loc[i, ["vs_verdict", "vs_method"]] = [c.word(), c.method]
    return out


@dataclass
class Pairs:
    """Cell a's and cell b's run folders paired by seed on one run kind, the seeds refused (two kinds) and those
    only one trained cell has. An untrained cell pairs with each seed of the other on that seed's kind."""

    a: dict = field(default_factory=dict)  # seed -> run_dir
    b: dict = field(default_factory=dict)
    kind: dict = field(default_factory=dict)  # seed -> the pair's run kind, as tables print it
    refused: list = field(default_factory=list)  # (seed, run_dir a, kind a, run_dir b, kind b)
    unpaired: tuple = ({}, {})  # seed -> run_dir of the seeds only cell a (b) has
    kinds: set = field(default_factory=set)  # every kind either cell's records ran on
    untrained: tuple = (False, False)  # whether cell a (b) is one evaluation a kind

    def only(self, kind: str) -> "Pairs":
        """The pairs that ran on `kind`."""
        keep = [s for s in self.a if self.kind[s] == kind]
        return Pairs({s: self.a[s] for s in keep}, {s: self.b[s] for s in keep}, {s: kind for s in keep},
                     kinds={kind}, untrained=self.untrained)


def _side(ok, key) -> tuple[bool, list]:
    """(whether cell `key` of records `ok` is untrained, its records as (seed, run_dir, kind))."""
    part = ok[ok.cell_key == key]
    kinds = part.run_kind.map(kind_name) if "run_kind" in part else ["not recorded"] * len(part)
    return bool(len(part)) and part.params.fillna(0).eq(0).all(), list(zip(part.seed, part.run_dir, kinds))


def pairs(ok, key_a, key_b) -> Pairs:
    """The Pairs of cells `key_a` and `key_b` among records `ok`, each pair on one run kind (qft.frame.one_kind)."""
    (once_a, ra), (once_b, rb) = _side(ok, key_a), _side(ok, key_b)
    p = Pairs(kinds={k for _, _, k in ra + rb}, untrained=(once_a, once_b))
    if once_a or once_b:
        flip = once_a and not once_b  # the trained side first
        trained, fixed = (rb, ra) if flip else (ra, rb)
        on = {k: d for _, d, k in fixed}
        has = f"no evaluation on that kind (it has: {' / '.join(on) or 'no record'})"
        matched = [((s, d, k), (on.get(k), k if k in on else has)) for s, d, k in trained]
        if flip:
            matched = [((s, d2, k2), (d, k)) for (s, d, k), (d2, k2) in matched]
    else:
        b = {s: (d, k) for s, d, k in rb}
        matched = [((s, d, k), b[s]) for s, d, k in ra if s in b]
        p.unpaired = ({s: d for s, d, _ in ra if s not in b}, {s: d for s, d, _ in rb if s not in {x[0] for x in ra}})
    for (seed, dir_a, kind_a), (dir_b, kind_b) in matched:
        if dir_a is not None and dir_b is not None and one_kind(kind_a, kind_b):
            p.a[seed], p.b[seed], p.kind[seed] = dir_a, dir_b, kind_a
        else:
            p.refused.append((seed, dir_a, kind_a, dir_b, kind_b))
    return p


def compare_configs(ok, key_a, key_b, margin: float = MARGIN, metric: str = "accuracy", kind: str | None = None,
                    min_seeds: int = MIN_SEEDS) -> "stats.Comparison | None":
    """The stats.Comparison of cell `key_a` - `key_b` of records `ok` in `metric` at `margin` over their pairs (only
    `kind`'s where given); paired where both kept per-example scores, else Welch (or one-sample against an untrained
    cell); None with fewer than `min_seeds` pairs."""
    p = pairs(ok, key_a, key_b)
    if kind is not None:
        p = p.only(kind)
    ea, eb = example_scores(p.a, metric), example_scores(p.b, metric)
    seeds = sorted(p.a)
    if ea and eb:
        if len(seeds) < (1 if all(p.untrained) else min_seeds):
            # with fewer trained seeds the crossed model cannot see training noise well enough for a verdict (one
            # seed against an untrained cell would be a paired t over examples alone: 56% coverage simulated)
            return None
        rows_a, rows_b = [ea[s] for s in seeds], [eb[s] for s in seeds]
        if all(np.array_equal(x[0], rows_a[0][0]) for x in rows_a + rows_b):
            return stats.paired(np.stack([x[1] for x in rows_a]), np.stack([x[1] for x in rows_b]), margin)
    if metric != "accuracy":
        return None  # a log-likelihood comparison needs per-example scores
    if ea and eb:
        return None  # per-example scores on different examples: no comparison rather than a wrong one
    # records without per-example scores: over seeds only, which holds the test set fixed (its sampling noise is
    # not in the interval), so the method says so
    acc = ok.set_index("run_dir").acc_test
    if any(p.untrained):  # the pairs' differences against one evaluation a kind
        d = acc[list(p.a.values())].to_numpy(float) - acc[list(p.b.values())].to_numpy(float)
        c = stats.versus_constant(d, 0.0, margin) if len(d) > 1 else None
    else:
        one = kind is None and len(p.kinds) == 1  # every record of both cells on one kind: all their seeds
        a, b = ({**p.a, **p.unpaired[0]}, {**p.b, **p.unpaired[1]}) if one else (p.a, p.b)
        xa, xb = acc[list(a.values())].to_numpy(float), acc[list(b.values())].to_numpy(float)
        c = stats.welch(xa, xb, margin) if len(xa) > 1 and len(xb) > 1 else None
    if c is not None:
        c.method += ", this test set"
    return c


def example_scores(rows: dict, metric: str) -> dict | None:
    """{seed: (example ids, per-example scores in `metric`)} of `rows`' final test evaluations, or None if any run
    lacks them."""
    out = {}
    for seed, run_dir in rows.items():
        ex = read_examples(Path(run_dir))
        t = (ex or {}).get("final.test")
        if t is None:
            return None
        if metric != "accuracy" and "loglik" not in t:
            return None  # instruction data: exact match only
        out[seed] = (t["id"], t["correct"].astype(float) if metric == "accuracy"
                     else t["loglik"][np.arange(len(t["gold"])), t["gold"]])
    return out


def reference(part, versus: dict | None):
    """The row of group `part` the others are compared with: the one whose columns equal `versus`, else the best;
    None where `versus` matches none."""
    if not versus:
        return part.acc_mean.idxmax()
    hit = part[[all(equal(r[k], v) for k, v in versus.items()) for _, r in part.iterrows()]]
    return hit.index[0] if len(hit) else None


def equal(a, b) -> bool:
    """Whether table value `a` equals `b` as typed on a command line or in a plan: `8` matches 8 and 8.0."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)
