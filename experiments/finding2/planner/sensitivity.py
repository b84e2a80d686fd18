"""Finding 2's seed count, how sure: variance quantities of the variance pilot only (no cell mean or difference is
computed or printed). Per declared contrast 1 and 2: the seed and residual mean squares of the paired per-document
differences, the seed component, its 80% upper bound (chi-square on the seed mean square's 2 degrees of freedom, less
the residual: finding 1's amendment's method), and the planner's t-form power to find 0.02 at 0.05/5 with 4-6 seeds x
2,160 documents at each, and at finding 1's achieved seed component for its headline contrast (7.0e-5).

    python experiments/finding2/planner/sensitivity.py > experiments/finding2/planner/sensitivity.txt
"""
import numpy as np
from scipy import stats as st

from qft import stats
from qft.stats import _mean_squares
from qft.tools import power

RUNS = "results/finding2/runs"
CONTRASTS = {"contrast 1": ((5.656854, 5.656854), (22.627417, 22.627417)),
             "contrast 2": ((22.627417, 5.656854), (5.656854, 22.627417))}

for name, cells in CONTRASTS.items():
    folders = [f"{RUNS}/adapter.attn.alpha={a},adapter.mlp.alpha={m},seed={s}" for a, m in cells for s in (0, 1, 2)]
    a, b = power.by_config(power.runs(folders), "accuracy").values()
    d = np.stack([a[s][1] - b[s][1] for s in sorted(set(a) & set(b))])
    s, n = d.shape
    ms_s, ms_i, ms_e = _mean_squares(d)
    comp = {"seed": max((ms_s - ms_e) / n, 0.0), "example": max((ms_i - ms_e) / s, 0.0), "residual": ms_e}
    upper = ms_s * (s - 1) / st.chi2.ppf(0.2, s - 1)
    rows = {"estimate": comp["seed"], "80% upper bound": max((upper - ms_e) / n, 0.0),
            "finding 1's contrast 1 (7.0e-5)": 7.0e-5}
    print(f"{name}: seed MS {ms_s:.4g}, residual MS {ms_e:.4g}, example component {comp['example']:.3g}; "
          f"seed MS / residual MS {ms_s / ms_e:.3f}")
    for label, v in rows.items():
        c = {**comp, "seed": v}
        pw = [stats.power_difference(0.02, stats.design_se(c, k, 2160), stats.design_df(c, k, 2160), 0.01)
              for k in (4, 5, 6)]
        print(f"  seed component {label}: {v:.3g}; power to find 0.02 at 4/5/6 seeds: "
              + " / ".join(f"{p:.2f}" for p in pw))
