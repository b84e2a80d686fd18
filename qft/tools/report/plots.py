"""The report's PNG plots, drawn for whichever axes a study varies: accuracy against trainable parameters with its
Pareto frontier, rank and alpha heat maps, alpha curves, bits x rank panels, every cell with its interval, and the
learning curves. matplotlib is imported inside each function: it is an optional dependency (the `report` extra)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from qft.frame import THIRD_ALPHAS, THIRDS
from qft.tools.report.views import uneven_depth, varies

if TYPE_CHECKING:
    import pandas as pd

COLORS = {"none": "tab:gray", "attn": "tab:blue", "mlp": "tab:orange", "attn+mlp": "tab:green"}


def pareto(g) -> "pd.DataFrame":
    """The rows of summary `g` no other row beats on accuracy with as few or fewer trainable parameters."""
    best, keep = -1.0, []
    for i, r in g.sort_values(["params", "acc_mean"], ascending=[True, False]).iterrows():
        if r.acc_mean > best:
            keep.append(i)
            best = r.acc_mean
    return g.loc[keep]


def plot_learning_curves(names: list, table, out: Path, title: str) -> Path:
    """Plot learning-curve `table` (views.learning_curves: columns per run of `names`) titled `title` into
    `out`/learning_curves.png; returns the file."""
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
    """Label axes `ax`: x `xlabel`, y test accuracy, `title`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    """Save `fig` as `path` and close it; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path

def plot_accuracy_vs_params(g, out: Path, title: str) -> Path:
    """Plot summary `g`'s accuracy against trainable parameters with its Pareto frontier, titled `title`, into `out`;
    returns the file."""
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
    """Plot summary `g`'s mean accuracy as a `rows` x `cols` heat map titled `title` into `out`/`name`; returns the
    file."""
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
    """Plot summary `g`'s accuracy against alpha per layer type, titled `title`, into `out`; returns the file."""
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
    """Plot summary `g`'s accuracy against rank in one panel per (attention, MLP) bits, titled `title`, into `out`;
    returns the file."""
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
    """Plot every configuration of summary `g` with its 95% interval, labelled by what varies, titled `title`, into
    `out`/cells.png; returns the file."""
    import matplotlib.pyplot as plt

    varying = [c for c in ("attn_bits", "mlp_bits", "attn_r", "mlp_r", *THIRD_ALPHAS) if varies(g, c)] \
        + ([f"params_{t}" for t in THIRDS] if uneven_depth(g) else [])
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
    """Value `v` short for a label: 12,000 as 12k."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{x / 1e3:,.0f}k" if x >= 1e4 else f"{x:g}"
