"""Collect result records into one table and draw the layer-sensitivity plots.

    python -m qft.report results/rank_sweep/runs [more paths...] [--out results/rank_sweep]

Reads every result.json under the paths (the records are the single source of truth), writes runs.csv and
runs.parquet (one row a run), summary.md (one row a configuration, seeds pooled as mean, standard
deviation and a 95% interval) and PNG plots for whichever axes vary: accuracy against trainable parameters
with its Pareto frontier, an attention-rank x MLP-rank heat map, alpha curves per layer type, bits x rank
panels, and every configuration with its interval where cuts of equal size are compared (by depth third or bits).
Each configuration is compared with the best one, or with a reference (`--versus attn_r=8,mlp_r=8`), within groups
(`--within attn_bits`): the difference and its 95% Welch interval say whether it is larger than the seed noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qft import stats
from qft.record import RECORD, config_hash, flatten, read_examples

if TYPE_CHECKING:
    import pandas as pd

THIRDS = ("shallow", "middle", "deep")
MARGIN = 0.02  # the default equivalence margin, in accuracy
MIN_SEEDS = 3  # seeds both trained cells need for a paired verdict (2 under-cover; 1 cannot see training noise)
THIRD_ALPHAS = tuple(f"{t}_alpha" for t in THIRDS)
# the config keys a layer-sensitivity study varies, and their short column names
AXES = {"adapter.attn.r": "attn_r", "adapter.mlp.r": "mlp_r", "adapter.attn.alpha": "attn_alpha",
        "adapter.mlp.alpha": "mlp_alpha", "quant.attn.bits": "attn_bits", "quant.mlp.bits": "mlp_bits",
        "budget.params": "budget", "budget.shares": "budget_shares", "budget.method": "budget_method",
        **{f"adapter.depth_groups.{t}.alpha": f"{t}_alpha" for t in THIRDS}}


def row(rec: dict, path: Path) -> dict:
    params = rec.get("trainable_params") or {}
    per_type = params.get("per_layer_type") or {}
    per_third = params.get("per_depth_group") or {}
    final, zero = rec.get("final_accuracy") or {}, rec.get("zero_shot_accuracy") or {}
    r = {"run_dir": str(path.parent), "status": rec.get("status"), "error": rec.get("error"),
         "config_hash": rec.get("config_hash"), "seed": rec.get("seed"),
         "config_key": config_hash(rec.get("config") or {}, ignore=("seed",), inputs_=rec.get("inputs") or {}),
         "experiment": (rec.get("config") or {}).get("experiment"),
         "params": params.get("total"), "params_attn": per_type.get("attn"), "params_mlp": per_type.get("mlp"),
         **{f"params_{t}": per_third.get(t) for t in THIRDS},
         "adapted": "+".join(t for t in ("attn", "mlp") if per_type.get(t)) or "none",
         "acc_test": final.get("test"), "acc_val": final.get("val"), "zero_shot_test": zero.get("test"),
         "tokens_per_s": rec.get("train_tokens_per_second"), "peak_rss_bytes": (rec.get("memory") or {}).get("peak_rss_bytes"),
         "wall_seconds": rec.get("wall_seconds"), "base_bytes": (rec.get("base_bytes") or {}).get("total"),
         "cpu_kind": (rec.get("execution") or {}).get("cpu_kind"),
         "qft_commit": (rec.get("execution") or {}).get("qft_source") or (rec.get("execution") or {}).get("qft_commit"),
         "has_examples": bool(rec.get("examples")) and (path.parent / rec["examples"]).is_file(),
         "val_curve": rec.get("val_curve") or None, "val_loglik_curve": rec.get("val_loglik_curve") or None}
    flat = flatten(rec.get("config") or {})
    for key, short in AXES.items():
        r[short] = flat.get(key)
    for g, v in (rec.get("budget_ranks") or {}).items():  # a budget run's ranks were solved, not configured
        if f"{g}_r" in r:
            r[f"{g}_r"] = v
        else:
            r[f"budget_r_{g}"] = v
    r.update({f"cfg.{k}": v for k, v in flat.items()})
    if r["has_examples"]:
        r.update(class_scores(read_examples(path.parent, rec).get("final.test"), (rec.get("data") or {}).get("labels")))
    return r


def class_scores(t: dict | None, labels: list | None) -> dict:
    """Macro-F1 and each class's accuracy (recall) on a split's per-example predictions: beside accuracy where the
    classes are unbalanced (Reuters R8's test split is 49% earnings)."""
    if not t or "pred" not in t or not labels:
        return {}
    gold, pred = t["gold"], t["pred"]
    out, f1 = {}, []
    for c, name in enumerate(labels):
        n_gold, n_pred, tp = int((gold == c).sum()), int((pred == c).sum()), int(((gold == c) & (pred == c)).sum())
        if n_gold == 0:
            continue
        out[f"acc_class_{name}"] = tp / n_gold
        f1.append(2 * tp / (n_gold + n_pred))  # 2 precision recall / (precision + recall)
    out["macro_f1_test"] = float(np.mean(f1)) if f1 else None
    return out


def collect(paths) -> "pd.DataFrame":
    import pandas as pd

    rows = []
    for p in map(Path, paths):
        files = [p] if p.name == RECORD else sorted(p.rglob(RECORD))
        for f in files:
            try:
                rows.append(row(json.loads(f.read_text()), f))
            except (OSError, ValueError) as e:
                print(f"qft.report: skipping unreadable {f}: {e}", file=sys.stderr)
    return pd.DataFrame(rows)


def grouped(df, versus: dict | None = None, within: tuple = (), margin: float = MARGIN) -> "pd.DataFrame":
    """One row per configuration (the config hash without the seed), accuracy as mean, sd and 95% interval, and
    its comparison with the best configuration, or with the one matching `versus`, within each group of `within`.

    An untrained configuration (no adapter) is one deterministic evaluation, shown once whatever its seed count.
    Comparisons are paired over seeds and test examples where both sides kept per-example scores, Welch over seeds
    otherwise; their p-values are Holm-adjusted across the table, which is exploratory (a study's declared
    contrasts are in `contrasts`)."""
    ok = df[df.status == "ok"].drop_duplicates(["config_key", "seed"], keep="last").copy()  # one record a seed
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
    for col in ("vs_diff", "vs_low", "vs_high", "vs_p_adj"):
        out[col] = float("nan")
    out["vs_verdict"], out["vs_method"] = "", ""
    for i, c in comparisons.items():
        if c is not None:
            out.loc[i, ["vs_diff", "vs_low", "vs_high", "vs_p_adj"]] = [c.diff, c.low, c.high, c.p_adj]
            out.loc[i, ["vs_verdict", "vs_method"]] = [c.word(), c.method]
    return out


def _seed_rows(ok, key) -> dict:
    """seed -> run_dir of one configuration's ok records; an untrained configuration as one evaluation."""
    part = ok[ok.config_key == key]
    rows = dict(zip(part.seed, part.run_dir))
    return dict([next(iter(rows.items()))]) if part.params.fillna(0).eq(0).all() else rows


def compare_configs(ok, key_a, key_b, margin: float = MARGIN, metric: str = "accuracy") -> "stats.Comparison | None":
    """Configuration a - b on test accuracy: paired over shared seeds and examples where both kept per-example
    scores, else Welch over seeds (or one-sample against an untrained cell's one evaluation); None where neither
    side has the seeds for an interval."""
    a, b = _seed_rows(ok, key_a), _seed_rows(ok, key_b)
    ea, eb = _examples(a, metric), _examples(b, metric)
    once = {k for k, rows in (("a", a), ("b", b)) if _untrained(ok, rows)}  # one deterministic evaluation
    if ea and eb:
        seeds = None if once else sorted(set(ea) & set(eb))  # trained against trained: the seeds both have
        if seeds is not None and len(seeds) < MIN_SEEDS:
            return None  # with fewer seeds the crossed model cannot see training noise well enough for a verdict
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


def read_plan(path: Path) -> dict:
    """A study's declared analysis (plan.yaml): metric, margin, alpha, the contrasts (cell a - cell b, each cell as
    columns of the table) and the family the Holm adjustment covers (all the contrasts)."""
    import yaml

    try:
        plan = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--plan={path}: not a readable YAML file ({type(e).__name__})") from e
    contrasts = plan.get("contrasts")
    if not isinstance(contrasts, list) or not contrasts or not all(
            isinstance(c, dict) and {"name", "a", "b"} <= set(c) for c in contrasts):
        raise ValueError(f"--plan={path}: contrasts must be a list of {{name, a, b}} with a and b as column: value maps")
    if plan.get("metric", "accuracy") not in ("accuracy", "loglik"):
        raise ValueError(f"--plan={path}: metric must be accuracy or loglik")
    return {"metric": "accuracy", "margin": MARGIN, "alpha": 0.05, **plan}


def _contrast_keys(ok, contrast: dict) -> list:
    """The configuration keys of a contrast's cells a and b (None where no single configuration matches); a cell
    names columns of the table or dotted config keys."""
    keys = []
    for side in ("a", "b"):
        hit = ok[[all(_equal(r[k] if k in r else r.get(f"cfg.{k}"), v) for k, v in contrast[side].items())
                  for _, r in ok.iterrows()]]
        keys.append(hit.config_key.iloc[0] if hit.config_key.nunique() == 1 else None)
    return keys


def contrasts(df, g, plan: dict) -> tuple[list[dict], str]:
    """The declared contrasts with Holm across them, and their markdown table; where every contrast is paired and
    the metric is accuracy, the gold label's log-likelihood (continuous, more power) beside it, Holm across the
    same family, equivalence only within a declared `loglik_margin`."""
    ok = df[df.status == "ok"]
    keys = [_contrast_keys(ok, c) for c in plan["contrasts"]]
    found = [(c, compare_configs(ok, *k, plan["margin"], plan["metric"]) if None not in k else None)
             for c, k in zip(plan["contrasts"], keys)]
    stats.holm([comp for _, comp in found])  # the whole declared family, a missing contrast as p = 1
    comps = [comp for _, comp in found if comp is not None]
    for comp in comps:
        comp.alpha = plan["alpha"]
    loglik = {}
    if plan["metric"] == "accuracy" and comps and all(c.method == "paired-crossed" for c in comps):
        loglik = {i: compare_configs(ok, *k, plan.get("loglik_margin", 0.0), "loglik") if None not in k else None
                  for i, k in enumerate(keys)}
        stats.holm(list(loglik.values()))
        loglik = {i: x for i, x in loglik.items() if x is not None}
    rows = [{"name": c["name"], **({} if comp is None else comp.as_dict()),
             **({"loglik": loglik[i].as_dict()} if i in loglik else {})} for i, (c, comp) in enumerate(found)]
    lines = [f"Declared contrasts ({plan['metric']}, margin ±{plan['margin']:g}, alpha {plan['alpha']:g}, Holm across "
             f"all {len(found)}, {len(found) - len(comps)} of them not computable). Equivalence is TOST at alpha: the "
             f"{100 - 200 * plan['alpha']:g}% interval inside ±margin; the 95% interval is shown.", "",
             "| contrast | a - b | 95% CI | p | Holm p | verdict | method | seeds | examples |"
             + (" gold log-lik a - b [95% CI], Holm p |" if loglik else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if loglik else "")]
    for i, (c, comp) in enumerate(found):
        if comp is None:
            lines.append(f"| {c['name']} | - | - | - | - | not computable: a cell has no records, or fewer than "
                         f"{MIN_SEEDS} seeds both cells share | | | |" + (" |" if loglik else ""))
            continue
        v = comp.word()
        extra = ""
        if i in loglik:
            x = loglik[i]
            extra = f" {x.diff:+.4f} [{x.low:+.4f}, {x.high:+.4f}], {x.p_adj:.3g} |"
        lines.append(f"| {c['name']} | {comp.diff:+.4f} | [{comp.low:+.4f}, {comp.high:+.4f}] | {comp.p:.3g} | "
                     f"{comp.p_adj:.3g} | {v} | {comp.method} | {comp.n_seeds} | {comp.n_examples or '-'} |{extra}")
    return rows, "\n".join(lines) + "\n"


def reference(part, versus: dict | None):
    """The row a group is compared with: the best one, or the one whose columns equal `versus` (None if absent)."""
    if not versus:
        return part.acc_mean.idxmax()
    hit = part[[all(_equal(r[k], v) for k, v in versus.items()) for _, r in part.iterrows()]]
    return hit.index[0] if len(hit) else None


def _equal(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def pareto(g) -> "pd.DataFrame":
    """Configurations no other beats on accuracy with as few or fewer trainable parameters."""
    best, keep = -1.0, []
    for i, r in g.sort_values(["params", "acc_mean"], ascending=[True, False]).iterrows():
        if r.acc_mean > best:
            keep.append(i)
            best = r.acc_mean
    return g.loc[keep]


def learning_curves(ok) -> tuple[list[str], "pd.DataFrame"] | None:
    """Validation accuracy and gold-label log-likelihood against step, one column per run, labelled by the config
    keys that differ between the runs (a pilot's learning rates, say); None without curves of 3 or more points."""
    import pandas as pd

    runs = ok[ok.val_curve.map(lambda c: isinstance(c, list) and len(c) >= 3)] if "val_curve" in ok else ok.iloc[:0]
    if runs.empty:
        return None
    cfg = [c for c in runs if c.startswith("cfg.") and runs[c].map(repr).nunique() > 1]
    names = [", ".join(f"{c[4:]}={r[c]}" for c in cfg) or f"seed={r.seed}" for _, r in runs.iterrows()]
    cols = {}
    for name, (_, r) in zip(names, runs.iterrows()):
        cols[f"val acc ({name})"] = dict(map(tuple, r.val_curve))
        if isinstance(r.val_loglik_curve, list):
            cols[f"val gold loglik ({name})"] = dict(map(tuple, r.val_loglik_curve))
    return names, pd.DataFrame(cols).sort_index().rename_axis("step")


def plot_learning_curves(names: list, table, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        for ax, what in zip(axes, ("val acc", "val gold loglik")):
            col = f"{what} ({name})"
            if col in table:
                ax.plot(table.index, table[col], "o-", ms=3, label=name)
    _label(axes[0], "step", title)
    axes[0].set_ylabel("validation accuracy")
    _label(axes[1], "step", "gold label log-likelihood (mean, validation)")
    axes[1].set_ylabel("mean log p(gold label)")
    return _save(fig, out / "learning_curves.png")


def _label(ax, xlabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


COLORS = {"none": "tab:gray", "attn": "tab:blue", "mlp": "tab:orange", "attn+mlp": "tab:green"}


def plot_accuracy_vs_params(g, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    x = g.params.where(g.params > 0, other=float("nan"))
    floor = (x.min() / 3) if x.notna().any() else 1.0
    xs = g.params.where(g.params > 0, other=floor)
    for kind, sub in g.groupby("adapted"):
        ax.errorbar(xs[sub.index], sub.acc_mean, yerr=sub.ci95.fillna(0.0), fmt="o", color=COLORS.get(kind),
                    label="no adapter (zero-shot)" if kind == "none" else f"adapters on {kind}", capsize=3)
    front = pareto(g)
    ax.plot(xs[front.index], front.acc_mean, "--", color="black", lw=1, label="Pareto frontier")
    ax.set_xscale("log")
    if (g.params == 0).any():
        ax.axvline(floor * 1.7, color="0.85", lw=0.8)
        ax.annotate("no adapter", (floor, ax.get_ylim()[0]), fontsize=7, ha="center", va="bottom")
    _label(ax, "trainable parameters (log)", title)
    return _save(fig, out / "accuracy_vs_params.png")


def plot_heatmap(g, out: Path, rows: str, cols: str, name: str, title: str) -> Path:
    import matplotlib.pyplot as plt

    table = g.pivot_table(index=rows, columns=cols, values="acc_mean", aggfunc="mean").sort_index(ascending=False)
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(table.values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns])
    ax.set_yticks(range(len(table.index)), [str(i) for i in table.index])
    ax.set_xlabel(cols.replace("_", " "))
    ax.set_ylabel(rows.replace("_", " "))
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            v = table.values[i, j]
            if not math.isnan(v):
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="white" if v < table.values[~table.isna().values].mean() else "black", fontsize=9)
    fig.colorbar(im, ax=ax, label="test accuracy")
    ax.set_title(title, fontsize=10)
    return _save(fig, out / name)


def plot_alpha_curves(g, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for lt, col in (("attn", "attn_alpha"), ("mlp", "mlp_alpha")):
        if g[col].nunique() > 1:
            curve = g.groupby(col).acc_mean.agg(["mean", "min", "max"])
            ax.plot(curve.index, curve["mean"], "o-", color=COLORS[lt], label=f"{lt} alpha (mean over the other)")
            ax.fill_between(curve.index, curve["min"], curve["max"], color=COLORS[lt], alpha=0.15)
    ax.set_xscale("log", base=2)
    _label(ax, "alpha", title)
    return _save(fig, out / "alpha_curves.png")


def plot_bits_rank(g, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    combos = sorted(g.groupby(["attn_bits", "mlp_bits"]).groups)
    fig, axes = plt.subplots(1, len(combos), figsize=(3.2 * len(combos), 3.4), sharey=True, squeeze=False)
    for ax, (ab, mb) in zip(axes[0], combos):
        sub = g[(g.attn_bits == ab) & (g.mlp_bits == mb)]
        for kind, s in sub.groupby("adapted"):
            ax.errorbar(s.params, s.acc_mean, yerr=s.ci95.fillna(0.0), fmt="o", color=COLORS.get(kind), capsize=3)
        for _, r in sub.iterrows():
            ax.annotate(f"a{r.attn_r}/m{r.mlp_r}", (r.params, r.acc_mean), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if sub.params.max() > 10 * max(sub.params.min(), 1):
            ax.set_xscale("log")
        else:  # a narrow range: a log axis would have no labelled tick in it
            ax.ticklabel_format(axis="x", style="sci", scilimits=(6, 6))
        ax.set_title(f"attn {ab}-bit, mlp {mb}-bit", fontsize=9)
        ax.set_xlabel("trainable parameters")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    fig.suptitle(title, fontsize=10)
    return _save(fig, out / "bits_rank.png")


def plot_cells(g, out: Path, title: str) -> Path:
    """Every configuration with its 95% interval, labelled by what varies: equal-size cuts side by side."""
    import matplotlib.pyplot as plt

    varying = [c for c in ("attn_bits", "mlp_bits", "attn_r", "mlp_r", *THIRD_ALPHAS) if _varies(g, c)] \
        + ([f"params_{t}" for t in THIRDS] if _uneven_depth(g) else [])
    order = g.sort_values([c for c in ("attn_bits", "mlp_bits") if c in varying] + ["params"], ascending=False)
    labels = [", ".join(f"{c.replace('params_', '')} {_short(r[c])}" for c in varying) for _, r in order.iterrows()]
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.32 * len(order)))
    y = range(len(order))
    ax.errorbar(order.acc_mean, y, xerr=order.ci95.fillna(0.0), fmt="o", color="black", capsize=3)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("test accuracy (mean over seeds, 95% interval)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, out / "cells.png")


def _short(v) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{x / 1e3:,.0f}k" if x >= 1e4 else f"{x:g}"


def _vs(r, versus) -> str:
    if r.name == r.vs_ref:
        return "reference" if versus else "best"
    if r.vs_ref < 0 or not r.vs_verdict:
        return ""
    return f"{r.vs_diff:+.3f} [{r.vs_low:+.3f}, {r.vs_high:+.3f}] p_adj {r.vs_p_adj:.2g} {r.vs_verdict}"


def markdown(g, df, versus: dict | None = None, within: tuple = (), margin: float = MARGIN) -> str:
    cols = ["adapted", *[c for c in AXES.values() if c in g.columns and g[c].nunique() > 1],
            *([f"params_{t}" for t in THIRDS] if _uneven_depth(g) else []), "params"]
    name = "vs " + (",".join(f"{k}={v}" for k, v in versus.items()) if versus else "best") \
        + (f" (per {', '.join(within)})" if within else "")
    f1 = "macro_f1" in g and g.macro_f1.notna().any()
    lines = ["| " + " | ".join(cols + ["n", "test acc", "95% CI", *(["macro-F1"] if f1 else []), name, "tokens/s"]) + " |",
             "|" + "---|" * (len(cols) + 5 + f1)]
    for _, r in g.iterrows():
        ci = "one evaluation" if r.n_seeds == 1 and (r.params or 0) == 0 else "" if math.isnan(r.ci95) else f"±{r.ci95:.3f}"
        lines.append("| " + " | ".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:g}" for c in cols)
                     + f" | {r.n_seeds} | {r.acc_mean:.3f} | {ci} |" + ((" |" if math.isnan(r.macro_f1) else f" {r.macro_f1:.3f} |") if f1 else "")
                     + f" {_vs(r, versus)} | {r.tokens_per_s:.0f} |")
    failed = df[df.status != "ok"]
    methods = sorted({m for m in g.vs_method if m})
    n = int((g.vs_verdict != "").sum())
    head = (f"{len(df)} runs: {int((df.status == 'ok').sum())} ok, {len(failed)} not ok. Test accuracy: mean over seeds "
            f"with its 95% t interval (an untrained cell is one evaluation){'; macro-F1: mean over seeds' if f1 else ''}. **Exploratory**: {name} is the difference "
            f"from the {'reference' if versus else 'best'} configuration{' of its group' if within else ''}, its 95% "
            f"interval (unadjusted), its Holm-adjusted p across these {n} comparisons and a verdict (differs / "
            f"equivalent within ±{margin:g} / inconclusive) from the adjusted tests ({', '.join(methods) or 'none'}; paired-crossed: per-example over seeds and examples, "
            "welch / one-sample, this test set: over seeds only, for records without per-example scores, so the test set's "
            "own sampling noise is not in the interval). The reference is the best cell on this same test set, which "
            "biases toward \"differs\": exploratory. A study's declared contrasts are in contrasts.md.")
    tail = [f"- {r.run_dir}: {r.status} {r.error or ''}" for _, r in failed.iterrows()]
    notes = _provenance(df[df.status == "ok"])
    return "\n".join([head, "", *lines, *([""] + notes if notes else []), *([""] + tail if tail else [])]) + "\n"


def _provenance(ok) -> list[str]:
    """What a reader must know before comparing: CPU kinds, commits, records without per-example scores."""
    notes = []
    kinds = sorted({str(k) for k in ok.get("cpu_kind", []) if k})
    if len(kinds) > 1:
        notes.append(f"- these records span CPU kinds: {', '.join(kinds)}")
    commits = sorted({str(c)[:10] for c in ok.get("qft_commit", []) if c})
    if len(commits) > 1:
        notes.append(f"- these records span qft code versions (source digest, else commit): {', '.join(commits)}")
    missing = int((~ok.has_examples).sum()) if "has_examples" in ok else 0
    if missing:
        notes.append(f"- {missing} of {len(ok)} records keep no per-example scores (made before they were kept): "
                     "their comparisons are Welch over seeds, not paired, and they carry no log-likelihood analysis")
    return notes


def report(paths, out: Path | None = None, versus: dict | None = None, within: tuple = (),
           plan: Path | None = None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    df = collect(paths)
    if df.empty:
        raise ValueError(f"paths={', '.join(map(str, paths))}: no {RECORD} under them")
    experiment = next((e for e in df.experiment if e), None) or "report"
    declared = read_plan(plan) if plan else None
    out = Path(out or Path("results") / experiment)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "runs.csv", index=False)
    df.astype({c: str for c in df.columns if df[c].dtype == object}).to_parquet(out / "runs.parquet", index=False)
    files = {"csv": out / "runs.csv", "parquet": out / "runs.parquet"}
    datasets = sorted(df["cfg.data.source"].dropna().unique()) if "cfg.data.source" in df else []
    for source in datasets or [None]:  # one table and set of plots per dataset: never pooled across tasks
        sub = df if source is None else df[df["cfg.data.source"] == source]
        where = out if len(datasets) <= 1 else out / source
        files.update({f"{source}/{k}" if len(datasets) > 1 else k: v
                      for k, v in _summarise(sub, where, experiment, versus, within, declared).items()})
    return files


def pd_none():
    import pandas as pd

    return pd.Series(dtype=object)


def _varies(g, column: str) -> bool:
    return column in g and g[column].nunique() > 1


def _uneven_depth(g) -> bool:
    """Whether some configuration gives the depth thirds different adapter sizes (a depth study)."""
    thirds = g[[f"params_{t}" for t in THIRDS]].dropna()
    return bool(len(thirds)) and bool((thirds.nunique(axis=1) > 1).any())


def _summarise(df, out: Path, experiment: str, versus: dict | None = None, within: tuple = (),
               plan: dict | None = None) -> dict:
    dtypes = sorted(set(df[df.status == "ok"].get("cfg.quant.compute_dtype", pd_none()).dropna()))
    if len(dtypes) > 1:
        raise ValueError(f"the records span compute dtypes {', '.join(dtypes)}: one comparison never mixes them; "
                         "report each apart")
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    g = grouped(df, versus, within)
    summary = markdown(g, df, versus, within)
    (out / "summary.md").write_text(summary)
    files["summary"] = out / "summary.md"
    if plan is not None:
        rows, text = contrasts(df, g, plan)
        (out / "contrasts.md").write_text(text)
        (out / "contrasts.json").write_text(json.dumps(rows, indent=1))
        files["contrasts"] = out / "contrasts.md"
        summary = text + "\n" + summary
    if not g.empty:
        title = f"{experiment}: {df['cfg.model.name'].iloc[0]}, {df['cfg.data.source'].iloc[0]}"
        files["accuracy_vs_params"] = plot_accuracy_vs_params(g, out, title)
        if _varies(g, "attn_r") and _varies(g, "mlp_r") and not (_varies(g, "attn_bits") or _varies(g, "mlp_bits")):
            files["rank_heatmap"] = plot_heatmap(g, out, "attn_r", "mlp_r", "rank_heatmap.png", title)
        if _varies(g, "attn_alpha") or _varies(g, "mlp_alpha"):
            files["alpha_curves"] = plot_alpha_curves(g, out, title)
            if _varies(g, "attn_alpha") and _varies(g, "mlp_alpha"):
                files["alpha_heatmap"] = plot_heatmap(g, out, "attn_alpha", "mlp_alpha", "alpha_heatmap.png", title)
        if _varies(g, "attn_bits") or _varies(g, "mlp_bits"):
            files["bits_rank"] = plot_bits_rank(g, out, title)
        if _uneven_depth(g) or any(_varies(g, c) for c in ("attn_bits", "mlp_bits", *THIRD_ALPHAS)):
            files["cells"] = plot_cells(g, out, title)
    curves = learning_curves(df[df.status == "ok"])
    if curves is not None:
        names, table = curves
        lines = ["| step | " + " | ".join(table.columns) + " |", "|---:|" + "---:|" * len(table.columns)]
        lines += [f"| {step} | " + " | ".join("" if v != v else f"{v:.4f}" for v in row) + " |"
                  for step, row in zip(table.index, table.itertuples(index=False))]
        (out / "learning_curves.md").write_text("\n".join(lines) + "\n")
        files["learning_curves"] = plot_learning_curves(names, table, out, f"{experiment}: validation during training")
    print(f"## {out}\n\n{summary}")
    return files


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qft.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="folders searched for result.json (or result.json files)")
    ap.add_argument("--out", help="output folder (default results/<experiment>)")
    ap.add_argument("--versus", default="", help="the reference configuration, as columns of the table: "
                    "attn_r=8,mlp_r=8 (default: the best configuration)")
    ap.add_argument("--within", default="", help="compare within groups of these columns: attn_bits,mlp_bits")
    ap.add_argument("--plan", help="the study's declared analysis (plan.yaml: contrasts, margin, metric); its contrasts "
                    "are printed first with Holm across them, the rest is exploratory")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        versus = dict(kv.split("=", 1) for kv in args.versus.split(",") if kv) or None
    except ValueError:
        print(f"qft.report: error: --versus={args.versus}: COLUMN=VALUE pairs separated by commas", file=sys.stderr)
        return 2
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"qft.report: error: paths={missing}: no such file or folder", file=sys.stderr)
        return 2
    try:
        files = report(args.paths, args.out, versus, tuple(c for c in args.within.split(",") if c), args.plan)
    except ValueError as e:
        print(f"qft.report: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
