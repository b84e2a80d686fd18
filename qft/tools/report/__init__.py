"""Collect result records into one table and draw the layer-sensitivity plots.

    python -m qft.tools.report results/rank_sweep/runs [more paths...] [--out results/rank_sweep]

Reads every result.json under the paths (the records are the single source of truth), writes runs.csv and
runs.parquet (one row a run), summary.md (one row a configuration, seeds pooled as mean, standard
deviation and a 95% interval) and PNG plots for whichever axes vary: accuracy against trainable parameters
with its Pareto frontier, an attention-rank x MLP-rank heat map, alpha curves per layer type, bits x rank
panels, and every configuration with its interval where cuts of equal size are compared (by depth third or bits).
Each configuration is compared with the best one, or with a reference (`--versus attn_r=8,mlp_r=8`), within groups
(`--within attn_bits`): the difference and its 95% Welch interval say whether it is larger than the seed noise.

One module a concern: frame (records into a frame), compare (seeds pooled, configurations compared over pairs of one
run kind), plan (a plan.yaml read and checked), declared (a plan's controls and contrasts), kinds (each contrast by
run kind), tables (markdown), plots (PNG), summary (the files of a report), cli (`python -m qft.tools.report`).
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
