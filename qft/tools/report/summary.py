"""A report's files: the runs table, then per dataset the summary, declared contrasts, learning curves and the
plots its axes call for; one table a dataset, because accuracies of different tasks never pool."""

from __future__ import annotations

import json
from pathlib import Path

from qft.record import RECORD
from qft.tools.report.compare import grouped
from qft.tools.report.declared import contrasts
from qft.tools.report.plan import read_plan
from qft.frame import THIRD_ALPHAS, collect
from qft.tools.report.views import learning_curves, uneven_depth, varies
from qft.tools.report.plots import (plot_accuracy_vs_params, plot_alpha_curves, plot_bits_rank, plot_cells, plot_heatmap,
                              plot_learning_curves)
from qft.tools.report.tables import classes_markdown, curves_markdown, markdown


def report(paths, out: Path | None = None, versus: dict | None = None, within: tuple = (),
           plan: Path | None = None) -> dict:
    """Write the report of the records under `paths` into `out` (default results/<experiment>), comparing with
    `versus` within `within` groups, `plan`'s declared analysis first; returns {name: file}. Raises ValueError where
    there is no record or the plan is bad."""
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
    """An empty object Series."""
    import pandas as pd

    return pd.Series(dtype=object)


def _summarise(df, out: Path, experiment: str, versus: dict | None = None, within: tuple = (),
               plan: dict | None = None) -> dict:
    """Write one dataset's summary, classes, contrasts, curves and plots of frame `df` into `out`, titled by
    `experiment` (`versus`, `within`, `plan` as report's); returns {name: file}."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    g = grouped(df, versus, within)
    summary = markdown(g, df, versus, within)
    (out / "summary.md").write_text(summary)
    files["summary"] = out / "summary.md"
    per_class = classes_markdown(g, df)
    if per_class is not None:
        (out / "classes.md").write_text(per_class)
        files["classes"] = out / "classes.md"
    if plan is not None:
        rows, text = contrasts(df, g, plan)
        (out / "contrasts.md").write_text(text)
        (out / "contrasts.json").write_text(json.dumps(rows, indent=1))
        files["contrasts"] = out / "contrasts.md"
        summary = text + "\n" + summary
    if not g.empty:
        title = f"{experiment}: {df['cfg.model.name'].iloc[0]}, {df['cfg.data.source'].iloc[0]}"
        files["accuracy_vs_params"] = plot_accuracy_vs_params(g, out, title)
        if varies(g, "attn_r") and varies(g, "mlp_r") and not (varies(g, "attn_bits") or varies(g, "mlp_bits")):
            files["rank_heatmap"] = plot_heatmap(g, out, "attn_r", "mlp_r", "rank_heatmap.png", title)
        if varies(g, "attn_alpha") or varies(g, "mlp_alpha"):
            files["alpha_curves"] = plot_alpha_curves(g, out, title)
            if varies(g, "attn_alpha") and varies(g, "mlp_alpha"):
                files["alpha_heatmap"] = plot_heatmap(g, out, "attn_alpha", "mlp_alpha", "alpha_heatmap.png", title)
        if varies(g, "attn_bits") or varies(g, "mlp_bits"):
            files["bits_rank"] = plot_bits_rank(g, out, title)
        if uneven_depth(g) or any(varies(g, c) for c in ("attn_bits", "mlp_bits", *THIRD_ALPHAS)):
            files["cells"] = plot_cells(g, out, title)
    curves = learning_curves(df[df.status == "ok"])
    if curves is not None:
        names, table = curves
        (out / "learning_curves.md").write_text(curves_markdown(table))
        files["learning_curves"] = plot_learning_curves(names, table, out, f"{experiment}: validation during training")
    print(f"## {out}\n\n{summary}")
    return files
