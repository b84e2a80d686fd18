"""The statistics every verdict uses, from scipy and statsmodels: Welch over seeds, a paired comparison over seeds and
test examples, Holm across a declared family, TOST equivalence, three verdicts, and the power of a design.

A paired comparison is the two-way crossed random-effects model over seeds and test examples, its interval and
p-values from a generalized pivotal quantity over the ANOVA mean squares, with fixed random streams so the same
records give the same numbers. Why this model, and its measured size and coverage: docs/studies.md, "The paired
model".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats as st
from scipy.optimize import brentq
from scipy.special import ndtr

if TYPE_CHECKING:  # pandas is imported where a frame is built, not with every verdict
    import pandas as pd

VERDICTS = ("differs", "equivalent", "inconclusive")


@dataclass
class Comparison:
    """One contrast A - B: difference, standard error, degrees of freedom, 95% interval and p-values (two-sided for a
    difference, TOST within +-margin, minimum-effect beyond +-margin); `p_adj`, `p_tost_adj` and `p_beyond_adj` are
    filled in across a family (holm)."""

    diff: float
    se: float
    df: float
    low: float
    high: float
    p: float
    p_tost: float
    margin: float
    method: str
    n_seeds: int
    n_examples: int | None = None
    p_adj: float | None = None
    p_tost_adj: float | None = None
    alpha: float = 0.05
    components: dict | None = None  # a paired comparison's own crossed variance components (seed, example, residual)
    p_beyond: float = 1.0
    p_beyond_adj: float | None = None

    @property
    def verdict(self) -> str:
        return verdict(self, self.alpha)

    @property
    def within_margin(self) -> bool:
        """TOST also rejects a difference of ±margin: a "differs" that is real but smaller than the margin."""
        q = self.p_tost_adj if self.p_tost_adj is not None else self.p_tost
        return q < self.alpha

    @property
    def beyond_margin(self) -> bool:
        """The minimum-effect test rejects every difference within ±margin: a "differs" larger than the margin, which
        a claim that one effect is larger than another (finding 2's) needs beside the other's equivalence."""
        q = self.p_beyond_adj if self.p_beyond_adj is not None else self.p_beyond
        return q < self.alpha

    def negated(self) -> "Comparison":
        """B - A from A - B."""
        return Comparison(-self.diff, self.se, self.df, -self.high, -self.low, self.p, self.p_tost, self.margin,
                          self.method, self.n_seeds, self.n_examples, self.p_adj, self.p_tost_adj, self.alpha,
                          self.components, self.p_beyond, self.p_beyond_adj)

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict, "within_margin": self.within_margin,
                "beyond_margin": self.beyond_margin}

    def word(self) -> str:
        """The verdict as a table prints it."""
        v = self.verdict
        if v == "equivalent":
            return f"equivalent within ±{self.margin:g}"
        if v == "differs" and self.within_margin:
            return f"differs (by less than ±{self.margin:g})"
        return f"differs (by more than ±{self.margin:g})" if v == "differs" and self.beyond_margin else v


def _finish(diff: float, se: float, df: float, margin: float, method: str, n_seeds: int, n_examples=None,
            level: float = 0.95) -> Comparison:
    """The Comparison of difference `diff` with standard error `se` at `df` degrees of freedom (t-based interval at
    `level`, p, TOST and minimum-effect p against `margin`), labelled `method`, `n_seeds`, `n_examples`."""
    if not (math.isfinite(se) and math.isfinite(diff)):  # nothing to judge by: no claim either way
        return Comparison(diff, se, df, -math.inf, math.inf, 1.0, 1.0, margin, method, n_seeds, n_examples)
    if se == 0:  # every paired difference identical: the difference is exact
        p = 0.0 if diff != 0 else 1.0
        p_tost = 0.0 if abs(diff) < margin else 1.0
        return Comparison(diff, se, df, diff, diff, p, p_tost, margin, method, n_seeds, n_examples,
                          p_beyond=0.0 if abs(diff) > margin else 1.0)
    q = st.t.ppf(0.5 + level / 2, df)
    p = 2 * st.t.sf(abs(diff) / se, df)
    p_tost = max(st.t.sf((diff + margin) / se, df), st.t.cdf((diff - margin) / se, df))
    # the chance, at a true difference on the margin, of an estimate at least this far from 0 on either side
    p_beyond = min(1.0, st.t.sf((abs(diff) - margin) / se, df) + st.t.sf((abs(diff) + margin) / se, df))
    return Comparison(diff, se, df, diff - q * se, diff + q * se, p, p_tost, margin, method, n_seeds, n_examples,
                      p_beyond=p_beyond)


def welch(a, b, margin: float = 0.02) -> Comparison:
    """The Welch comparison of per-seed scores `a` and `b` (unpaired; TOST against `margin`): for records without
    per-example scores. Raises ValueError with fewer than two seeds a side."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch needs at least two seeds a side")
    return welch_from_summary(a.mean(), a.std(ddof=1), len(a), b.mean(), b.std(ddof=1), len(b), margin)


def _mean_squares(d: np.ndarray) -> tuple[float, float, float]:
    """The two-way ANOVA mean squares (seed, example, residual) of `d`, an (S >= 2 seeds x N examples) matrix."""
    s, n = d.shape
    mean, rows, cols = d.mean(), d.mean(1), d.mean(0)
    ms_s = n * ((rows - mean) ** 2).sum() / (s - 1)
    ms_i = s * ((cols - mean) ** 2).sum() / (n - 1)
    ms_e = ((d - rows[:, None] - cols[None, :] + mean) ** 2).sum() / ((s - 1) * (n - 1))
    return ms_s, ms_i, ms_e


def crossed(d: np.ndarray) -> tuple[float, float, float, dict]:
    """(mean, standard error, Satterthwaite df, variance components) of `d`, an (S seeds x N examples) matrix of
    paired differences, under the crossed random-effects model: the power planner's inputs."""
    d = np.asarray(d, float)
    if d.ndim == 1:
        d = d[None, :]
    s, n = d.shape
    mean = d.mean()
    if s == 1:  # one evaluation: the paired t-test over examples
        ms_i = d.var(ddof=1)
        return mean, math.sqrt(ms_i / n), n - 1, {"seed": 0.0, "example": ms_i, "residual": 0.0}
    ms_s, ms_i, ms_e = _mean_squares(d)
    # a negative component estimate is taken as zero (the larger of the two one-effect estimates), and every mean
    # square's uncertainty stays in Satterthwaite's degrees of freedom, truncated or not. Dropping the seed term's
    # df when it truncates under-covered (0.92 at 3 seeds and 1,000 examples); keeping the unbiased estimate
    # instead under-covered where the example term truncates (0.92). This one covers 0.94-0.985 in
    # tests/test_stats.py's and the review's simulations: conservative where 3 seeds cannot tell a small seed
    # variance from none
    combo = max(ms_s + ms_i - ms_e, ms_s, ms_i)
    denom = ms_s ** 2 / (s - 1) + ms_i ** 2 / (n - 1) + ms_e ** 2 / ((s - 1) * (n - 1))
    df = combo ** 2 / denom if denom > 0 else float(s * n - 1)
    components = {"seed": max((ms_s - ms_e) / n, 0.0), "example": max((ms_i - ms_e) / s, 0.0), "residual": ms_e}
    return mean, math.sqrt(combo / (s * n)), df, components


def paired(a: np.ndarray, b: np.ndarray, margin: float = 0.02) -> Comparison:
    """The Comparison A - B of per-example scores `a` and `b` (S seeds x N examples, rows in one seed order; a row of
    b may be one evaluation repeated, as for a zero-shot cell), against `margin`, by `generalized`."""
    a, b = np.atleast_2d(np.asarray(a, float)), np.atleast_2d(np.asarray(b, float))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired needs the same examples: {a.shape[1]} against {b.shape[1]}")
    if b.shape[0] == 1 and a.shape[0] > 1:
        b = np.repeat(b, a.shape[0], 0)
    if a.shape[0] == 1 and b.shape[0] > 1:
        a = np.repeat(a, b.shape[0], 0)
    if a.shape != b.shape:
        raise ValueError(f"paired needs the same seeds: {a.shape[0]} against {b.shape[0]}")
    d = a - b
    mean, se, df, comp = crossed(d)
    if a.shape[0] == 1:
        return _finish(mean, se, df, margin, "paired-crossed", 1, a.shape[1])
    low, high, p, p_tost, p_beyond = generalized(d, margin)
    if is_correctness(d) and np.ptp(d) > 0:  # correctness records: the mean's and the split's pivots (`beyond_correct`)
        p_beyond = beyond_correct(d, margin)
    return Comparison(mean, se, df, low, high, p, p_tost, margin, "paired-crossed", a.shape[0], a.shape[1],
                      components=comp, p_beyond=p_beyond)


def detectable(c: Comparison, alpha: float, power: float = 0.8) -> float | None:
    """The smallest difference the design of Comparison `c` (seeds, examples, variance components) finds with
    `power` at level `alpha`, by a two-sided t at Satterthwaite's df; None without components, or above 1."""
    if not c.components:
        return None
    se, df = design_se(c.components, c.n_seeds, c.n_examples), design_df(c.components, c.n_seeds, c.n_examples)
    return smallest_difference(se, df, alpha, power)


GPQ_DRAWS = 20_000


def generalized(d: np.ndarray, margin: float, level: float = 0.95) -> tuple[float, float, float, float, float]:
    """(low, high, p, TOST p, minimum-effect p) at `level` and `margin` for the mean of `d`, an (S seeds x N examples)
    matrix of paired differences, from the generalized pivotal quantity R = mean - Z sqrt(V*), V* = (MS_s (S-1)/U_s
    + MS_i (N-1)/U_i - MS_e (S-1)(N-1)/U_e) / (S N), U chi-square (Weerahandi 1993; Burdick & Graybill 1992), Z
    integrated out over a fixed stream of draws. Why not Satterthwaite's t: docs/studies.md, "The paired model"."""
    mean, cdf, sd = _pivot(d)
    if cdf is None:  # every paired difference the same: the difference is exact
        return mean, mean, float(mean == 0), float(abs(mean) >= margin), float(abs(mean) <= margin)
    pos = sd > 0

    def quantile(q: float) -> float:
        w = float(np.median(sd[pos])) or 1e-12
        lo, hi = mean - w, mean + w
        while cdf(lo) > q:
            lo = mean - 2 * (mean - lo)
        while cdf(hi) < q:
            hi = mean + 2 * (hi - mean)
        return float(brentq(lambda r: cdf(r) - q, lo, hi, xtol=1e-7))

    below = cdf(0.0)
    p = min(1.0, 2 * min(below, 1 - below))
    p_tost = max(cdf(-margin), 1 - cdf(margin))
    return quantile((1 - level) / 2), quantile((1 + level) / 2), p, p_tost, _beyond(mean, cdf, margin)


def _pivot(d: np.ndarray):
    """(mean, cdf of the generalized pivotal quantity, the pivot's sd per draw) of paired-difference matrix `d`; cdf
    None where every difference is the same."""
    s, n = d.shape
    mean = d.mean()
    ms_s, ms_i, ms_e = _mean_squares(d)
    rng = np.random.default_rng(20261204)
    u_s, u_i = rng.chisquare(s - 1, GPQ_DRAWS), rng.chisquare(n - 1, GPQ_DRAWS)
    u_e = rng.chisquare((s - 1) * (n - 1), GPQ_DRAWS)
    sd = np.sqrt(np.maximum(ms_s * (s - 1) / u_s + ms_i * (n - 1) / u_i - ms_e * (s - 1) * (n - 1) / u_e, 0) / (s * n))
    pos = sd > 0
    if not pos.any():
        return mean, None, sd

    def cdf(r: float) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.where(pos, ndtr((r - mean) / np.where(pos, sd, 1)), r >= mean).mean())

    return mean, cdf, sd


def beyond_mean(d: np.ndarray, margin: float) -> float:
    """The mean's pivot's minimum-effect p of `d` against `margin` (`generalized`'s, without its interval): for
    records other than correctness, and the size test."""
    mean, cdf, _ = _pivot(np.asarray(d, float))
    return float(abs(mean) <= margin) if cdf is None else _beyond(mean, cdf, margin)


def _beyond(mean: float, cdf, margin: float) -> float:
    """The minimum-effect p from pivot `cdf` at `margin` m: P(R <= m) + P(R <= -m) for a `mean` above 0, mirrored
    below: the chance, at a true difference on the margin, of a pivot at least this far from 0 on either side."""
    return min(1.0, cdf(margin) + cdf(-margin) if mean >= 0 else 2 - cdf(-margin) - cdf(margin))


def holm(comparisons: list) -> list:
    """`comparisons` with p_adj, p_tost_adj and p_beyond_adj set by Holm's step-down adjustment (statsmodels), each
    kind across the family; a None member counts as p = 1, so the family never shrinks."""
    from statsmodels.stats.multitest import multipletests

    if comparisons:
        adj = multipletests([c.p if c else 1.0 for c in comparisons], method="holm")[1]
        adj_tost = multipletests([c.p_tost if c else 1.0 for c in comparisons], method="holm")[1]
        adj_beyond = multipletests([c.p_beyond if c else 1.0 for c in comparisons], method="holm")[1]
        for c, p, q, b in zip(comparisons, adj, adj_tost, adj_beyond):
            if c is not None:
                c.p_adj, c.p_tost_adj, c.p_beyond_adj = float(p), float(q), float(b)
    return comparisons


def verdict(c: Comparison, alpha: float = 0.05) -> str:
    """The verdict on Comparison `c` at `alpha`: "differs" (the adjusted test rejects no difference), "equivalent"
    (TOST rejects +-margin or more) or "inconclusive"; unadjusted p where no family was declared."""
    p = c.p_adj if c.p_adj is not None else c.p
    q = c.p_tost_adj if c.p_tost_adj is not None else c.p_tost
    if p < alpha:
        return "differs"
    if q < alpha:
        return "equivalent"
    return "inconclusive"


def describe(c: Comparison) -> str:
    """Comparison `c` as one line: difference, interval, p, adjusted p and its verdict."""
    word = c.word()
    padj = f", adjusted p {c.p_adj:.3g}" if c.p_adj is not None else ""
    return f"{c.diff:+.4f} [{c.low:+.4f}, {c.high:+.4f}] p {c.p:.3g}{padj}: {word}"


# --------------------------------------------------------------------------- power

def design_se(components: dict, seeds: int, examples: int) -> float:
    """The standard error of a paired mean difference over `seeds` x `examples`, from crossed variance `components`."""
    return math.sqrt(components["seed"] / seeds + components["example"] / examples
                     + components["residual"] / (seeds * examples))


def design_df(components: dict, seeds: int, examples: int) -> float:
    """The Satterthwaite df of design_se(`components`, `seeds`, `examples`); for seed-level components (records
    without per-example scores) those of Welch with equal spreads."""
    if components.get("unpaired"):
        return 2.0 * (seeds - 1)
    ms_s = components["residual"] + examples * components["seed"]
    ms_i = components["residual"] + seeds * components["example"]
    ms_e = components["residual"]
    combo = ms_s + ms_i - ms_e
    if seeds == 1:
        return examples - 1
    denom = ms_s ** 2 / (seeds - 1) + ms_i ** 2 / (examples - 1) + ms_e ** 2 / ((seeds - 1) * (examples - 1))
    return combo ** 2 / denom if denom > 0 else float(seeds * examples - 1)


def power_difference(delta: float, se: float, df: float, alpha: float) -> float:
    """The power of a two-sided t-test (`se`, `df`) at level `alpha` to find true difference `delta` (noncentral t).
    Both tails as upper tails: scipy's nct.cdf returns NaN far in the lower tail."""
    q = st.t.ppf(1 - alpha / 2, df)
    nc = delta / se
    return float(st.nct.sf(q, df, nc) + st.nct.sf(q, df, -nc))


def smallest_difference(se: float, df: float, alpha: float, power: float = 0.8) -> float | None:
    """The smallest difference, on a grid of 0.001, that a two-sided t-test of `se` and `df` finds with `power` at
    level `alpha`; None above 1."""
    if se == 0:
        return 0.0
    return next((d / 1000 for d in range(1, 1001) if power_difference(d / 1000, se, df, alpha) >= power), None)


def power_equivalence(margin: float, se: float, df: float, alpha: float, true_diff: float = 0.0) -> float:
    """The power of TOST (`se`, `df`, level `alpha`) to show equivalence within +-`margin` at true difference
    `true_diff`: the Bonferroni lower bound P(upper) + P(lower) - 1 (conservative below 10 df)."""
    q = st.t.ppf(1 - alpha, df)
    upper = st.nct.sf(q, df, (margin - true_diff) / se)  # P(reject diff >= +margin), as an upper tail (see above)
    lower = st.nct.sf(q, df, (true_diff + margin) / se)  # P(reject diff <= -margin)
    return float(max(0.0, upper + lower - 1))


# --------------------------------------------------------------------------- seed-level summaries

def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided Student t quantile (scipy) at `level` for `df` degrees of freedom."""
    return float(st.t.ppf(0.5 + level / 2, df))


def versus_constant(a, c: float, margin: float = 0.02) -> Comparison:
    """The one-sample t Comparison of per-seed scores `a` against constant `c` (an untrained cell's one evaluation),
    TOST against `margin`; raises ValueError with fewer than two seeds."""
    a = np.asarray(a, float)
    if len(a) < 2:
        raise ValueError("needs at least two seeds")
    return _finish(float(a.mean() - c), float(a.std(ddof=1) / math.sqrt(len(a))), len(a) - 1, margin, "one-sample",
                   len(a))


def seed_summary(g) -> pd.DataFrame:
    """n_seeds, acc_mean and acc_sd of test accuracy per group of `g`, a pandas groupby over the record frame."""
    import pandas as pd

    return pd.DataFrame({"n_seeds": g.acc_test.count(), "acc_mean": g.acc_test.mean(),
                         "acc_sd": g.acc_test.std().fillna(0.0)})


def welch_from_summary(mean_a, sd_a, n_a, mean_b, sd_b, n_b, margin: float = 0.02) -> Comparison:
    """The Welch Comparison from each side's mean, SD and seed count (`mean_a`, `sd_a`, `n_a`; `mean_b`, `sd_b`,
    `n_b`), TOST against `margin`."""
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    if se == 0:
        return _finish(float(mean_a - mean_b), 0.0, float(n_a + n_b - 2), margin, "welch", int(min(n_a, n_b)))
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    return _finish(float(mean_a - mean_b), se, df, margin, "welch", int(min(n_a, n_b)))


# --------------------------------------------------------------------------- minimum-effect test on correctness records

HERMITE = np.polynomial.hermite_e.hermegauss(24)  # nodes and weights of E f(Z), Z standard normal


def is_correctness(d) -> bool:
    """Whether every entry of paired-difference matrix `d` is -1, 0 or +1 (per-example correctness)."""
    return bool(np.isin(np.asarray(d), (-1.0, 0.0, 1.0)).all())


def beyond_correct(d, margin: float) -> float:
    """The minimum-effect p beyond +-`margin` of `d`, an (S >= 2 seeds x N examples) matrix of correctness
    differences (-1, 0, +1): the larger of beyond_mean's and _beyond_split's, so a claim needs both. Raises
    ValueError on another shape, other entries or a negative margin.

    The mean's pivot alone leans liberal here, the split's alone reads only the seeds' spread (docs/studies.md)."""
    d = np.asarray(d, float)
    _check_correct(d, margin)
    return max(beyond_mean(d, margin), _beyond_split(d, margin))


def _check_correct(d: np.ndarray, margin: float) -> None:
    """Raise ValueError unless `d` is a (seeds >= 2, examples >= 1) matrix of -1/0/+1 and `margin` finite, >= 0."""
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 1:
        raise ValueError(f"beyond_correct: d of shape {d.shape}; allowed: a (seeds >= 2, examples >= 1) matrix")
    if not is_correctness(d):
        raise ValueError("beyond_correct: d has entries other than -1, 0 and +1; allowed: correctness differences")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"beyond_correct: margin={margin}; allowed: a finite number >= 0")


def _beyond_split(d: np.ndarray, margin: float) -> float:
    """The minimum-effect p beyond +-`margin` of correctness differences `d` from a generalized pivot on each seed's
    split of its discordant examples, l_s = log((P_s + 1/2) / (M_s + 1/2)), on a fixed stream of draws.

    The model and its pivot (Krishnamoorthy & Mathew 2003): docs/studies.md, "The paired model"."""
    s, n = d.shape
    x = d if d.mean() >= 0 else -d  # the mean's side, as `_beyond` takes it
    plus, minus = (x > 0).sum(1) + 0.5, (x < 0).sum(1) + 0.5
    logit = np.log(plus / minus)
    binomial = float(np.mean(1 / plus + 1 / minus))
    rng = np.random.default_rng(20261207)
    var = (s - 1) * logit.var(ddof=1) / rng.chisquare(s - 1, GPQ_DRAWS)
    theta = logit.mean() - rng.standard_normal(GPQ_DRAWS) * np.sqrt(var / s)
    tau = np.sqrt(np.maximum(var - binomial, 0))
    r = np.abs(x)
    rate = r.mean() - rng.standard_normal(GPQ_DRAWS) * crossed(r)[1]
    z, w = HERMITE
    diff = rate * (np.tanh((theta[:, None] + tau[:, None] * z[None, :]) / 2) @ (w / w.sum()))  # 2 expit(x) - 1
    return min(1.0, float(np.mean(diff <= margin) + np.mean(diff <= -margin)))
