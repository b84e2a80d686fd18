"""Finding 2's minimum-effect test, how far to trust it: the size at the margin of the report's own paired test
(`qft.stats.generalized`) on simulated studies shaped like this task's records, checked before the study's report is
read. "Reproduced" needs a value contrast shown beyond ±0.02 by that test; an audit (2026-12-06) found it liberal
(0.10-0.11 at 0.05) in one sparse model, so the write-up states the size found here beside any such claim.

Blind: the shape comes from finding 1's and finding 3's committed records only (the same task, data format, official
test split and 5 seeds; their verdicts are published), from the pairs of their 5-seed cells whose mean difference lies
near the margin (0.01-0.03 either way; discordance rises with the difference): how many documents a pair disagrees on
and in how many seeds (a zero-inflated beta-binomial, fitted by maximum likelihood), and the seed and example
components their paired differences reach. No finding 2 record is opened.

A simulated study: 5 seeds x 2,160 documents. Document i is discordant in a seed with chance pi_i (the fit); a
discordant (seed s, document i) goes to side A with chance expit(theta + a_s + b_i): a_s moves every discordant
document of a seed one way (finding 3's int8 cells had one seed 70-80 documents off the others), b_i makes the
difference come from a fixed set of documents. theta, sd(a) and sd(b) are solved (on quantile grids of both laws) so
that the true mean difference is exactly on the margin (+0.02: the minimum-effect test's and TOST's size) or 0 (the
difference test's) with the target seed and example components of the crossed model; a target the model cannot reach
is printed as such. Seed laws, each at unit variance before scaling: normal; two-point (a seed goes one way or the
other); contaminated (one seed in ten from a law 4x as wide, heavy-tailed). Each row gives sizes with 95%
Clopper-Pearson intervals over its simulated studies, and the minimum-effect p-value's quantiles at the margin at
Holm's five thresholds (0.05/k): the nominal levels at which it would hold them. With --calibrate P..., the
calibrated p-value of each observed minimum-effect p: the largest, over the rows near the margin (every row but the
stress rows), of (k + 1) / (n + 1), k of n simulated studies at the margin having a p at or below it, and Holm's
adjustment of them.

    python experiments/finding2/size_check.py > experiments/finding2/size_check.txt
    python experiments/finding2/size_check.py --reps 10 > experiments/finding2/size_check_reps10.txt  # the test's
"""
from __future__ import annotations

import argparse
import collections
import itertools

import numpy as np
from scipy import optimize, stats as st
from scipy.special import expit
from statsmodels.stats.multitest import multipletests

from qft import stats
from qft.tools import power

SOURCES = ("results/finding1/runs", "results/finding3/runs")
SEEDS, DOCS, MARGIN = 5, 2160, 0.02
NEAR = (0.01, 0.03)  # |mean difference| of the pairs that give the shape
LAWS = ("normal", "two-point", "contaminated")
# contaminated: (1 - WIDE) N(0, c^2) + WIDE N(0, (WIDE_SCALE c)^2), of variance WIDE_VAR c^2
WIDE, WIDE_SCALE = 0.1, 4.0
WIDE_VAR = 1 - WIDE + WIDE * WIDE_SCALE ** 2
HOLM = (0.05, 0.025, 0.05 / 3, 0.0125, 0.01)  # Holm's thresholds over five claims


def pairs() -> list[np.ndarray]:
    """Every pair of 5-seed trained cells within a source: the (seed x document) matrix of correct(A) - correct(B),
    read as the power planner reads records (`qft.tools.power`)."""
    out = []
    for source in SOURCES:
        full = [v for v in power.by_config(power.runs([source]), "accuracy").values()
                if sorted(v) == list(range(SEEDS))]
        for a, b in itertools.combinations(full, 2):
            assert all(np.array_equal(a[s][0], b[s][0]) for s in range(SEEDS))
            out.append(np.stack([a[s][1] - b[s][1] for s in range(SEEDS)]))
    return out


def fit_discordance(ds: list[np.ndarray]) -> tuple[float, float, float, np.ndarray]:
    """Zero-inflated beta-binomial of a document's discordant seeds out of 5, by maximum likelihood over the pairs."""
    hist = sum(np.bincount((d != 0).sum(0), minlength=SEEDS + 1) for d in ds)
    k = np.arange(SEEDS + 1)

    def pmf(x):
        w, a, b = expit(x[0]), np.exp(x[1]), np.exp(x[2])
        return (1 - w) * st.betabinom.pmf(k, SEEDS, a, b) + w * (k == 0)

    res = optimize.minimize(lambda x: -(hist * np.log(pmf(x))).sum(), [0.0, 0.0, 2.0], method="Nelder-Mead",
                            options={"xatol": 1e-8, "fatol": 1e-10, "maxiter": 4000})
    return expit(res.x[0]), np.exp(res.x[1]), np.exp(res.x[2]), np.vstack([hist, hist.sum() * pmf(res.x)])


def seed_law(law: str, sd: float, size, rng) -> np.ndarray:
    if law == "normal":
        return rng.normal(0, sd, size)
    if law == "two-point":
        return sd * rng.choice([-1.0, 1.0], size)
    wide = rng.random(size) < WIDE
    return rng.normal(0, sd / np.sqrt(WIDE_VAR), size) * np.where(wide, WIDE_SCALE, 1.0)


def grid(law: str, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of a unit-variance law: its quantiles at m probability midpoints (exact enough for the
    near-step integrands of a nearly fixed direction, where Gauss-Hermite is not)."""
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
    """theta, sd(a) and sd(b) whose true mean difference is `target` and whose crossed-model seed and example
    components are `seed_comp` and `ex_comp` (None: sd(b) = 0, documents then differ only in how often they are
    discordant), from the first two moments `pi` of the discordance chance (independent of the direction).
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


def study(rng, shape, law, theta, sd_a, sd_b) -> np.ndarray:
    w, a, b = shape
    pi = np.where(rng.random(DOCS) < w, 0.0, rng.beta(a, b, DOCS))
    disc = rng.random((SEEDS, DOCS)) < pi
    side = rng.random((SEEDS, DOCS)) < expit(theta + seed_law(law, sd_a, (SEEDS, 1), rng) + rng.normal(0, sd_b, DOCS))
    return np.where(disc, np.where(side, 1.0, -1.0), 0.0)


def rate(hits: int, n: int) -> str:
    ci = st.binomtest(hits, n).proportion_ci(0.95)
    return f"{hits / n:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def simulate(row: tuple, shape: tuple, pi: tuple, reps: int) -> dict | None:
    """One row's studies: at the margin (the minimum-effect test's and TOST's p, the report's component estimates,
    the mean) and at a true 0 (the difference test's p). None where the model cannot reach the targets."""
    seed_target, ex_target, law, _ = row
    try:
        margin, null = (calibrate(t, seed_target, ex_target, law, pi) for t in (MARGIN, 0.0))
    except ValueError:
        return None
    rng = np.random.default_rng(20261206)  # every row's one stream: --calibrate draws the same studies as the table,
    out = collections.defaultdict(list)  # so it simulates the truth-0 studies too, though it reads none of them
    for _ in range(reps):
        d = study(rng, shape, law, *margin)
        c = stats.crossed(d)[3]
        _, _, _, p_tost, p_beyond = stats.generalized(d, MARGIN)
        out["est"].append([c["seed"], c["example"], c["residual"], d.mean()])
        out["beyond"].append(p_beyond)
        out["tost"].append(p_tost)
        out["diff"].append(stats.generalized(study(rng, shape, law, *null), MARGIN)[2])
    return {k: np.array(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000, help="simulated studies a row")
    ap.add_argument("--calibrate", type=float, nargs="+", metavar="P",
                    help="observed minimum-effect p-values to calibrate against the rows near the margin")
    args = ap.parse_args()
    if args.reps < 2:
        ap.error(f"--reps={args.reps}: an integer >= 2")
    if args.calibrate and not all(0 <= p <= 1 for p in args.calibrate):
        ap.error(f"--calibrate: p-values in [0, 1], not {args.calibrate}")
    ds = pairs()
    near = [d for d in ds if NEAR[0] <= abs(d.mean()) <= NEAR[1]]
    comps = {name: np.array([[c["seed"], c["example"], c["residual"]] for c in (stats.crossed(d)[3] for d in group)])
             for name, group in (("all", ds), ("near", near))}
    print(f"Shape from the {len(near)} of {len(ds)} pairs of 5-seed cells ({', '.join(SOURCES)}) whose mean "
          f"difference lies {NEAR[0]}-{NEAR[1]} either way; no finding 2 record read.")
    for j, name in enumerate(("seed", "example", "residual")):
        q = np.quantile(comps["near"][:, j], [0, 0.5, 1])
        print(f"  {name} component over them: min {q[0]:.2g}, median {q[1]:.2g}, max {q[2]:.2g}")
    w, a, b, hist = fit_discordance(near)
    pi = ((1 - w) * a / (a + b), (1 - w) * a * (a + 1) / ((a + b) * (a + b + 1)))
    print(f"  discordant seeds a document, 0-5, observed: {hist[0].astype(int).tolist()}; zero-inflated "
          f"beta-binomial fit: {np.round(hist[1]).astype(int).tolist()} (never discordant {w:.3f}, else "
          f"Beta({a:.3f}, {b:.3f}); mean discordance a seed {pi[0]:.4f})")
    seed_near = np.quantile(comps["near"][:, 0], [0.5, 1])
    stress = np.quantile(comps["all"][:, 0], 0.9)
    ex_near = np.quantile(comps["near"][:, 1], 0.5)
    rows = [(s_t, e_t, law, s_t == stress) for s_t in (0.0, *seed_near, stress) for e_t in (None, ex_near)
            for law in (LAWS if s_t > 0 else LAWS[:1])]
    if args.calibrate:
        sims = [simulate(r, (w, a, b), pi, args.reps) for r in rows if not r[3]]
        # (k + 1) / (n + 1): a Monte Carlo p-value that holds its level at any n (Davison & Hinkley 1997, ch. 4)
        calibrated = [max((int((s["beyond"] <= p).sum()) + 1) / (len(s["beyond"]) + 1) for s in sims if s)
                      for p in args.calibrate]
        holm = multipletests(calibrated, method="holm")[1]
        for p, c, h in zip(args.calibrate, calibrated, holm):
            print(f"minimum-effect p {p:.4g}: calibrated {c:.4f}, Holm over the {len(calibrated)} given {h:.4f}")
        return
    print(f"\nSize: the chance the test claims what is false, {args.reps} simulated studies a row. Seed component "
          f"0, the near pairs' median {seed_near[0]:.2g} and max {seed_near[1]:.2g}, and a stress row at all "
          f"{len(ds)} pairs' 90th percentile {stress:.2g} (pairs whose difference is near 0); example component from "
          f"how often documents are discordant only (none) or the near pairs' median {ex_near:.2g}. Minimum-effect "
          f"and TOST at a true +0.02, the difference test at a true 0 with the same target components. Estimated: "
          f"the means of the report's component estimates (truncated at 0, so above a small target).\n")
    print("| seed law | seed comp. (target / estimated) | example comp. (target / estimated) | residual | "
          "mean at +0.02 | minimum-effect p < 0.05 | minimum-effect p < 0.01 | TOST p < 0.05 | "
          "difference p < 0.05 (true 0) |")
    print("|---|---|---|---|---|---|---|---|---|")
    quantiles = []
    for row in rows:
        seed_target, ex_target, law, is_stress = row
        name = f"{law}{' (stress)' if is_stress else ''} | {seed_target:.2g}"
        ex = "none" if ex_target is None else f"{ex_target:.2g}"
        sim = simulate(row, (w, a, b), pi, args.reps)
        if sim is None:
            print(f"| {name} / - | {ex} / - | beyond the model's reach |||||")
            continue
        est, n = sim["est"].mean(0), args.reps
        print(f"| {name} / {est[0]:.2g} | {ex} / {est[1]:.2g} | {est[2]:.3f} | {est[3]:+.4f} | "
              f"{rate(int((sim['beyond'] < 0.05).sum()), n)} | {rate(int((sim['beyond'] < 0.01).sum()), n)} | "
              f"{rate(int((sim['tost'] < 0.05).sum()), n)} | {rate(int((sim['diff'] < 0.05).sum()), n)} |", flush=True)
        levels = " | ".join(f"{np.quantile(sim['beyond'], h):.4f}" for h in HOLM)
        quantiles.append(f"| {name} | {ex} | {levels} |")
    print("\nThe minimum-effect p's quantiles at the margin: the nominal level that would hold each of Holm's "
          "thresholds in that row.\n")
    print("| seed law | seed comp. | example comp. | " + " | ".join(f"{h:.4g}" for h in HOLM) + " |")
    print("|---|---|---|" + "---|" * len(HOLM))
    print("\n".join(quantiles))


if __name__ == "__main__":
    main()
