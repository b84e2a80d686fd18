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
adjustment of them. The sampler and the fit live in `qft.tools.studysim`, shared with tests/test_size.py. The
minimum-effect p here is the mean's pivot's (`generalized`), which the report used on every paired contrast until
`stats.beyond_correct` (which also reads a pivot on each seed's split) replaced it on correctness records: this
output is the old test's size, kept as run.

    python experiments/finding2/size_check.py > experiments/finding2/size_check.txt
    python experiments/finding2/size_check.py --reps 10 > experiments/finding2/size_check_reps10.txt  # the test's
"""
from __future__ import annotations

import argparse
import collections

import numpy as np
from scipy import stats as st
from statsmodels.stats.multitest import multipletests

from qft import stats
from qft.tools.studysim import LAWS, MARGIN, NEAR, SOURCES, calibrate, fit_discordance, pairs, study

HOLM = (0.05, 0.025, 0.05 / 3, 0.0125, 0.01)  # Holm's thresholds over five claims


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
