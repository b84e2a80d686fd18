"""Simulated paired studies shaped like sparse per-example correctness records: 5 seeds x 2,160 documents of -1/0/+1
differences, fitted to finding 1's and finding 3's committed records; experiments/finding2/size_check.py and
tests/test_size.py draw from it.

A document is discordant with chance pi_i (zero-inflated beta-binomial), a discordant (seed s, document i) goes to A
with chance expit(theta + a_s + b_i); `calibrate` solves theta, sd(a), sd(b) for a target. Seed laws: normal,
two-point, contaminated (one seed in ten from a law WIDE_SCALE as wide).
"""
from __future__ import annotations

import itertools

import numpy as np
from scipy import optimize, stats as st
from scipy.special import expit

from qft.tools import power

SOURCES = ("results/finding1/runs", "results/finding3/runs")
SEEDS, DOCS, MARGIN = 5, 2160, 0.02
NEAR = (0.01, 0.03)  # |mean difference| of the pairs that give the shape
LAWS = ("normal", "two-point", "contaminated")
# contaminated: (1 - WIDE) N(0, c^2) + WIDE N(0, (WIDE_SCALE c)^2), of variance WIDE_VAR c^2
WIDE, WIDE_SCALE = 0.1, 4.0
WIDE_VAR = 1 - WIDE + WIDE * WIDE_SCALE ** 2


def pairs(sources=SOURCES) -> list[np.ndarray]:
    """The (seed x document) matrix correct(A) - correct(B) of every pair of 5-seed trained cells within each of
    `sources`, read as qft.tools.power reads records."""
    out = []
    for source in sources:
        full = [v for v in power.by_config(power.runs([source]), "accuracy").values()
                if sorted(v) == list(range(SEEDS))]
        for a, b in itertools.combinations(full, 2):
            assert all(np.array_equal(a[s][0], b[s][0]) for s in range(SEEDS))
            out.append(np.stack([a[s][1] - b[s][1] for s in range(SEEDS)]))
    return out


def fit_discordance(ds: list[np.ndarray]) -> tuple[float, float, float, np.ndarray]:
    """(w, a, b, observed and fitted histograms) of the zero-inflated beta-binomial of a document's discordant seeds
    out of 5, by maximum likelihood over pair matrices `ds`."""
    hist = sum(np.bincount((d != 0).sum(0), minlength=SEEDS + 1) for d in ds)
    k = np.arange(SEEDS + 1)

    def pmf(x):
        w, a, b = expit(x[0]), np.exp(x[1]), np.exp(x[2])
        return (1 - w) * st.betabinom.pmf(k, SEEDS, a, b) + w * (k == 0)

    res = optimize.minimize(lambda x: -(hist * np.log(pmf(x))).sum(), [0.0, 0.0, 2.0], method="Nelder-Mead",
                            options={"xatol": 1e-8, "fatol": 1e-10, "maxiter": 4000})
    return expit(res.x[0]), np.exp(res.x[1]), np.exp(res.x[2]), np.vstack([hist, hist.sum() * pmf(res.x)])


def seed_law(law: str, sd: float, size, rng) -> np.ndarray:
    """Seed effects of shape `size` with standard deviation `sd` under `law` (one of LAWS), drawn from `rng`."""
    if law == "normal":
        return rng.normal(0, sd, size)
    if law == "two-point":
        return sd * rng.choice([-1.0, 1.0], size)
    wide = rng.random(size) < WIDE
    return rng.normal(0, sd / np.sqrt(WIDE_VAR), size) * np.where(wide, WIDE_SCALE, 1.0)


def grid(law: str, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, weights) of unit-variance `law`: its quantiles at `m` probability midpoints, exact enough for near-step
    integrands, where Gauss-Hermite is not."""
    if law == "two-point":
        return np.array([-1.0, 1.0]), np.array([0.5, 0.5])
    z = st.norm.ppf((np.arange(m) + 0.5) / m)
    z /= z.std()
    if law == "normal":
        return z, np.full(m, 1 / m)
    c = 1 / np.sqrt(WIDE_VAR)  # contaminated, at variance 1
    return (np.concatenate([c * z, WIDE_SCALE * c * z]),
            np.concatenate([np.full(m, (1 - WIDE) / m), np.full(m, WIDE / m)]))


def calibrate(target: float, seed_comp: float, ex_comp: float | None, law: str, pi: tuple) -> tuple[float, ...]:
    """(theta, sd(a), sd(b)) under `law` whose true mean difference is `target` and whose seed and example components
    are `seed_comp` and `ex_comp` (None: sd(b) = 0), given the discordance chance's first two moments `pi`. Raises
    ValueError where no sd in (0, 30] reaches a target."""
    xa, wa = grid(law, 200)
    xb, wb = grid("normal", 2000)

    def moments(theta, sd_a, sd_b):
        sign = 2 * expit(theta + sd_a * xa[:, None] + sd_b * xb[None, :]) - 1  # seed nodes x document nodes
        by_seed, by_doc = sign @ wb, wa @ sign
        mean = wa @ by_seed
        return pi[0] * mean, pi[0] ** 2 * (wa @ (by_seed - mean) ** 2), pi[1] * (wb @ by_doc ** 2) - (pi[0] * mean) ** 2

    def theta_for(sd_a, sd_b):
        return optimize.brentq(lambda t: moments(t, sd_a, sd_b)[0] - target, -40, 40, xtol=1e-10)

    sd_a = sd_b = 0.0
    for _ in range(6):  # each sd solved in turn, theta kept on target, until both components are
        if seed_comp:
            sd_a = optimize.brentq(lambda x: moments(theta_for(x, sd_b), x, sd_b)[1] - seed_comp, 1e-5, 30, xtol=1e-8)
        if ex_comp is not None:
            sd_b = optimize.brentq(lambda x: moments(theta_for(sd_a, x), sd_a, x)[2] - ex_comp, 1e-5, 30, xtol=1e-8)
        theta = theta_for(sd_a, sd_b)
        _, got_seed, got_ex = moments(theta, sd_a, sd_b)
        if abs(got_seed - seed_comp) <= 1e-3 * max(seed_comp, 1e-9) and (
                ex_comp is None or abs(got_ex - ex_comp) <= 1e-3 * ex_comp):
            return theta, sd_a, sd_b
    raise ValueError("no joint solution")


def study(rng, shape, law, theta, sd_a, sd_b, reps: int | None = None) -> np.ndarray:
    """One simulated study from `rng` (a seeds x documents matrix of -1/0/+1) with `shape` (w, a, b), `law`, `theta`,
    `sd_a`, `sd_b`; or `reps` stacked (drawn together: not the stream of `reps` single studies)."""
    w, a, b = shape
    lead = () if reps is None else (reps,)
    pi = np.where(rng.random(lead + (1, DOCS)) < w, 0.0, rng.beta(a, b, lead + (1, DOCS)))
    disc = rng.random(lead + (SEEDS, DOCS)) < pi
    side = rng.random(lead + (SEEDS, DOCS)) < expit(theta + seed_law(law, sd_a, lead + (SEEDS, 1), rng)
                                                    + rng.normal(0, sd_b, lead + (1, DOCS)))
    return np.where(disc, np.where(side, 1.0, -1.0), 0.0)


def near_shape(sources=SOURCES) -> tuple[tuple, tuple, list, list]:
    """((w, a, b), the discordance chance's first two moments, the near pairs, all pairs) fitted to the pairs of
    `sources` whose mean difference is near the margin (NEAR)."""
    ds = pairs(sources)
    near = [d for d in ds if NEAR[0] <= abs(d.mean()) <= NEAR[1]]
    w, a, b, _ = fit_discordance(near)
    pi = ((1 - w) * a / (a + b), (1 - w) * a * (a + 1) / ((a + b) * (a + b + 1)))
    return (w, a, b), pi, near, ds
