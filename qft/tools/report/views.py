"""What the report reads off the records' frame (qft.frame): learning curves, and which axes a study varies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qft.frame import THIRDS

if TYPE_CHECKING:
    import pandas as pd


def learning_curves(ok) -> tuple[list[str], "pd.DataFrame"] | None:
    """(run names, frame of validation accuracy and gold-label log-likelihood against step, a column per run) of
    records `ok`, runs named by the config keys that differ; None without curves of 3 or more points."""
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


def varies(g, column: str) -> bool:
    """Whether `column` of summary `g` takes more than one value."""
    return column in g and g[column].nunique() > 1


def uneven_depth(g) -> bool:
    """Whether some configuration of summary `g` gives the depth thirds different adapter sizes (a depth study)."""
    thirds = g[[f"params_{t}" for t in THIRDS]].dropna()
    return bool(len(thirds)) and bool((thirds.nunique(axis=1) > 1).any())
