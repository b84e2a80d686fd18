"""Collect result records into one table and draw the layer-sensitivity plots.

    python -m qft.tools.report results/rank_sweep/runs [more paths...] [--out results/rank_sweep]

Writes runs.csv and runs.parquet (a row a run), summary.md (a row a configuration, seeds pooled, each compared with
the best or `--versus`, within `--within` groups), a plan's declared contrasts (`--plan`) and PNG plots for whichever
axes vary. Modules: compare, plan, declared, kinds, tables, plots, views, summary, cli.
"""

from __future__ import annotations

from qft.tools.report.cli import main, parser  # noqa: F401
from qft.tools.report.compare import MARGIN, MIN_SEEDS, compare_configs, grouped, reference  # noqa: F401
from qft.tools.report.declared import contrasts  # noqa: F401
from qft.tools.report.plan import read_plan  # noqa: F401
from qft.frame import AXES, THIRD_ALPHAS, THIRDS, class_scores, collect, row  # noqa: F401
from qft.tools.report.views import learning_curves  # noqa: F401
from qft.tools.report.plots import COLORS, pareto, plot_accuracy_vs_params, plot_alpha_curves, plot_bits_rank  # noqa: F401
from qft.tools.report.plots import plot_cells, plot_heatmap, plot_learning_curves  # noqa: F401
from qft.tools.report.summary import pd_none, report  # noqa: F401
from qft.tools.report.tables import classes_markdown, markdown  # noqa: F401
