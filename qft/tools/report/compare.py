"""Configurations against each other: seeds pooled per configuration, and a difference with its interval and
verdict, paired over examples where the records allow it, so a reader sees whether it beats the seed noise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qft import stats
from qft.record import read_examples
from qft.frame import AXES, THIRDS

if TYPE_CHECKING:
    import pandas as pd

MARGIN = 0.02  # the default equivalence margin, in accuracy
MIN_SEEDS = 3  # seeds both trained cells need for a paired verdict (2 under-cover; 1 cannot see training noise)


def one_record_a_seed(df) -> tuple["pd.DataFrame", list[str]]:
    """The ok records, one a configuration and seed (a repeat: another machine, thread count or pipeline layout,
    none of them hashed): the last by folder stands, in every table; and the folders of those left out, to name."""
    ok = df[df.status == "ok"]
    if "config_key" not in ok:
        return ok, []
    repeat = ok.duplicated(["config_key", "seed"], keep="last")  # a mask: records of several folders may share labels
    return ok[~repeat], sorted(Path(str(d)).name for d in ok[repeat].get("run_dir", []))


def grouped(df, versus: dict | None = None, within: tuple = (), margin: float = MARGIN) -> "pd.DataFrame":
    """One row per configuration (the config hash without the seed), accuracy as mean, sd and 95% interval, and
    its comparison with the best configuration, or with the one matching `versus`, within each group of `within`.

    An untrained configuration (no adapter) is one deterministic evaluation, shown once whatever its seed count.
    Comparisons are paired over seeds and test examples where both sides kept per-example scores, Welch over seeds
    otherwise; their p-values are Holm-adjusted across the table, which is exploratory (a study's declared
    contrasts are in `contrasts`)."""
    ok = one_record_a_seed(df)[0].copy()
    keep = ["params", "params_attn", "params_mlp", *[f"params_{t}" for t in THIRDS], "adapted",
            *[a for a in AXES.values() if ok[a].notna().any()]]
    for col in [*(versus or {}), *within]:
        if col not in ok:
            raise ValueError(f"column {col!r} is not in the records; allowed: {', '.join(keep)}")
    g = ok.groupby("config_key", sort=False)
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
                comparisons[i] = compare_configs(ok, out.config_key[i], out.config_key[ref], margin)
    stats.holm(list(comparisons.values()))
    for col in ("vs_diff", "vs_low", "vs_high", "vs_p_adj", "vs_p_tost_adj"):
        out[col] = float("nan")
    out["vs_verdict"], out["vs_method"] = "", ""
    for i, c in comparisons.items():
        if c is None:
            runs = [d for k in (out.config_key[i], out.config_key[out.vs_ref[i]]) for d in seed_rows(ok, k).values()]
            if mixed(ok, runs):
                out.loc[i, "vs_verdict"] = "not comparable"  # its records ran on different kinds of execution
        else:
            out.loc[i, ["vs_diff", "vs_low", "vs_high", "vs_p_adj", "vs_p_tost_adj"]] = [c.diff, c.low, c.high, c.p_adj,
                                                                                       c.p_tost_adj]
            out.loc[i, ["vs_verdict", "vs_method"]] = [c.word(), c.method]
    return out


def seed_rows(ok, key) -> dict:
    """seed -> run_dir of one configuration's ok records; an untrained configuration as one evaluation."""
    part = ok[ok.config_key == key]
    rows = dict(zip(part.seed, part.run_dir))
    return dict([next(iter(rows.items()))]) if rows and part.params.fillna(0).eq(0).all() else rows


def compare_configs(ok, key_a, key_b, margin: float = MARGIN, metric: str = "accuracy") -> "stats.Comparison | None":
    """Configuration a - b on test accuracy: paired over shared seeds and examples where both kept per-example
    scores, else Welch over seeds (or one-sample against an untrained cell's one evaluation); None where neither
    side has the seeds for an interval."""
    a, b = seed_rows(ok, key_a), seed_rows(ok, key_b)
    if mixed(ok, [*a.values(), *b.values()]):
        return None
    ea, eb = _examples(a, metric), _examples(b, metric)
    once = {k for k, rows in (("a", a), ("b", b)) if _untrained(ok, rows)}  # one deterministic evaluation
    if ea and eb:
        seeds = None if once else sorted(set(ea) & set(eb))  # trained against trained: the seeds both have
        # the trained seeds: those both cells share, or the trained side's against an untrained cell
        trained = len(seeds) if seeds is not None else min(
            (len(e) for k, e in (("a", ea), ("b", eb)) if k not in once), default=MIN_SEEDS)
        if trained < MIN_SEEDS:
            # with fewer trained seeds the crossed model cannot see training noise well enough for a verdict (one
            # seed against an untrained cell would be a paired t over examples alone: 56% coverage simulated)
            return None
        rows_a = [ea[s] for s in seeds] if seeds else list(ea.values())
        rows_b = [eb[s] for s in seeds] if seeds else list(eb.values())
        if all(np.array_equal(x[0], rows_a[0][0]) for x in rows_a + rows_b):
            return stats.paired(np.stack([x[1] for x in rows_a]), np.stack([x[1] for x in rows_b]), margin)
    if metric != "accuracy":
        return None  # a log-likelihood comparison needs per-example scores
    if ea and eb:
        return None  # per-example scores on different examples: no comparison rather than a wrong one
    # records without per-example scores: over seeds only, which holds the test set fixed (its sampling noise is
    # not in the interval), so the method says so
    acc = {k: ok.set_index("run_dir").acc_test[list(v.values())].to_numpy(float) for k, v in (("a", a), ("b", b))}
    c = None
    if len(acc["a"]) > 1 and len(acc["b"]) > 1:
        c = stats.welch(acc["a"], acc["b"], margin)
    elif len(acc["a"]) > 1 and len(acc["b"]) == 1:
        c = stats.versus_constant(acc["a"], acc["b"][0], margin)
    elif len(acc["b"]) > 1 and len(acc["a"]) == 1:
        c = stats.versus_constant(acc["b"], acc["a"][0], margin).negated()
    if c is not None:
        c.method += ", this test set"
    return c


def mixed(ok, run_dirs: list) -> list[str]:
    """The kinds of execution a comparison's records span where there is more than one (none recorded counts as
    one more): a difference between them could be the machine's, not the configuration's."""
    kinds = ok.set_index("run_dir").run_kind.reindex(run_dirs)
    found = sorted({"not recorded" if k is None or k != k else str(k) for k in kinds})
    return found if len(found) > 1 else []


def _untrained(ok, rows: dict) -> bool:
    return bool(rows) and ok.set_index("run_dir").params.reindex(list(rows.values())).fillna(0).eq(0).all()


def _examples(rows: dict, metric: str) -> dict | None:
    """seed -> (example ids, per-example scores) of the final test evaluation, or None if any run lacks them."""
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
    """The row a group is compared with: the best one, or the one whose columns equal `versus` (None if absent)."""
    if not versus:
        return part.acc_mean.idxmax()
    hit = part[[all(equal(r[k], v) for k, v in versus.items()) for _, r in part.iterrows()]]
    return hit.index[0] if len(hit) else None


def equal(a, b) -> bool:
    """A table value against one typed on the command line or in a plan: `8` matches 8 and 8.0."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)
