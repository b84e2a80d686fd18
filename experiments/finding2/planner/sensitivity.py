"""Finding 2's seed count, how sure: variance quantities of the variance pilot only (no cell mean or difference is
computed or printed). Per declared contrast 1 and 2: the seed and residual mean squares of the paired per-document
differences, the chance of a seed mean square so far below the residual's were the seed component 0, and the seed
component at its estimate, at the 80%, 90% and 95% upper bounds of its mean square (chi-square on 2 degrees of
freedom, less the residual: finding 1's amendment's method) and at finding 1's achieved 7.0e-5 for its headline
contrast (a pessimistic case). At each: the power to find 0.02 at 0.05/5 with 4, 5 and 6 seeds x 2,160 documents
(the planner's t form, and the report's own generalized test simulated over 400 studies at 4 and 5 seeds) and the
power to show ±0.02 at a true difference of 0 (t form).

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
N, ALPHA, DELTA = 2160, 0.01, 0.02

for name, cells in CONTRASTS.items():
    folders = [f"{RUNS}/adapter.attn.alpha={a},adapter.mlp.alpha={m},seed={s}" for a, m in cells for s in (0, 1, 2)]
    a, b = power.by_config(power.runs(folders), "accuracy").values()
    d = np.stack([a[s][1] - b[s][1] for s in sorted(set(a) & set(b))])
    s, n = d.shape
    ms_s, _, ms_e = _mean_squares(d)
    comp = stats.crossed(d)[3]  # the planner's own components
    print(f"{name}: seed MS {ms_s:.4g}, residual MS {ms_e:.4g}, example component {comp['example']:.3g}; "
          f"seed MS / residual MS {ms_s / ms_e:.3f} (were the seed component 0, a ratio this low "
          f"{st.chi2.cdf((s - 1) * ms_s / ms_e, s - 1):.2f} of the time)")
    rows = {"estimate": comp["seed"]}
    for q in (0.8, 0.9, 0.95):
        rows[f"{q:.0%} upper bound"] = max((ms_s * (s - 1) / st.chi2.ppf(1 - q, s - 1) - ms_e) / n, 0.0)
    rows["finding 1's contrast 1 (7.0e-5, pessimistic)"] = 7.0e-5
    for label, v in rows.items():
        c = {**comp, "seed": v}
        find = [stats.power_difference(DELTA, stats.design_se(c, k, N), stats.design_df(c, k, N), ALPHA)
                for k in (4, 5, 6)]
        own = [power.simulated_power(c, k, N, DELTA, ALPHA, 400) for k in (4, 5)]
        show = [stats.power_equivalence(DELTA, stats.design_se(c, k, N), stats.design_df(c, k, N), ALPHA)
                for k in (4, 5, 6)]
        print(f"  seed component {label}: {v:.3g}; find 0.02 at 4/5/6 seeds: t "
              + " / ".join(f"{p:.2f}" for p in find) + ", the report's test (simulated) at 4/5: "
              + " / ".join(f"{p:.2f}" for p in own) + "; show ±0.02 at 4/5/6 (t): "
              + " / ".join(f"{p:.2f}" for p in show))
