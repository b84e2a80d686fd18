"""Finding 2's test on the alpha sweep's records: does accuracy follow the alpha values alone, whatever the
layer type they are set on?

    python experiments/alpha_sweep/analyse.py [results/alpha_sweep/runs]

Two views. (1) A least-squares fit, every seed's record a point, of
acc = c + u*log2(alpha_attn/16) + v*log2(alpha_mlp/16) + w*log2(alpha_attn/16)*log2(alpha_mlp/16):
u and v are each type's gain per doubling of its alpha at the default 16 on the other; if layer type does not
matter, u = v (the interval of u - v holds 0). (2) Mirrored cells: attention alpha a with MLP alpha b against
attention b with MLP a; if only the values matter they agree (Welch 95% interval of the difference holds 0).
"""

import sys

import numpy as np

from qft import stats
from qft.tools import report


def main(path="results/alpha_sweep/runs") -> None:
    df = report.collect([path]).query("status == 'ok'")
    a = np.log2(df.attn_alpha.astype(float).to_numpy() / 16)
    m = np.log2(df.mlp_alpha.astype(float).to_numpy() / 16)
    y = df.acc_test.astype(float).to_numpy()
    X = np.stack([np.ones_like(a), a, m, a * m], 1)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    dof = len(y) - X.shape[1]
    cov = (resid @ resid / dof) * np.linalg.inv(X.T @ X)
    t = stats.t_quantile(dof)
    print(f"fit of {len(y)} records ({dof} degrees of freedom, residual SE {np.sqrt(resid @ resid / dof):.4f}):")
    for name, d in (("u: attention, per doubling of its alpha", [0, 1, 0, 0]),
                    ("v: MLP, per doubling of its alpha", [0, 0, 1, 0]),
                    ("w: interaction", [0, 0, 0, 1]), ("u - v: attention minus MLP", [0, 1, -1, 0])):
        d = np.array(d, float)
        print(f"  {name}: {d @ coef:+.4f} ±{t * np.sqrt(d @ cov @ d):.4f} (95%)")
    g = stats.seed_summary(df.groupby(["attn_alpha", "mlp_alpha"]))
    print("mirrored cells (attention alpha, MLP alpha) against (MLP's, attention's):")
    for (x, z) in g.index:
        if x < z and (z, x) in g.index:
            a, b = g.loc[(x, z)], g.loc[(z, x)]
            c = stats.welch_from_summary(a.acc_mean, a.acc_sd, a.n_seeds, b.acc_mean, b.acc_sd, b.n_seeds)
            print(f"  attn {x:g}, mlp {z:g}: {a.acc_mean:.3f} vs attn {z:g}, mlp {x:g}: {b.acc_mean:.3f}: "
                  f"{stats.describe(c)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
