"""Seeds and test size a study needs, from pilot records: `python -m qft.tools.power RECORDS... --delta 0.02`.

From the crossed variance components of paired differences (qft.stats) it prints, per test size, the seeds needed
to find delta and to show equivalence at 80% power (a Bonferroni share of alpha for the family), and the hours that
takes on this CPU kind; pairs across run kinds are left out and named. `--simulate SEEDS` checks a seed count against
the report's own test, at the seed component as estimated and at multiples of it (docs/studies.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import numpy as np

from qft import frame, record, stats
from qft.errors import QftError, fail

SIZES = (200, 500, 1000, 2000)
SEED_SCALES = (1, 2, 4)
MAX_SEEDS = 100


def runs(paths) -> list[tuple[Path, dict]]:
    """(run folder, record) of every ok record at or under `paths`; raises QftError (RECORDS) where there is none."""
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise QftError("RECORDS", str(p), "a folder of result records (result.json) or one record")
        files = [p] if p.is_file() else sorted(p.rglob(record.RECORD))
        out += [(f.parent, r) for f in files if (r := record.read(f.parent)) and r.get("status") == "ok"]
    if not out:
        raise QftError("RECORDS", " ".join(map(str, paths)), "no ok result records there")
    return out


def scores(run_dir: Path, rec: dict, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(example ids, per-example score) of record `rec`'s final test evaluation in `run_dir`, the score per `metric`:
    correctness ("accuracy") or the gold label's log-likelihood ("loglik"); None where it kept none."""
    ex = record.read_examples(run_dir, rec)
    if not ex or "final.test" not in ex:
        return None
    t = ex["final.test"]
    if metric == "accuracy":
        return t["id"], t["correct"].astype(float)
    if "loglik" not in t:
        return None
    return t["id"], t["loglik"][np.arange(len(t["gold"])), t["gold"]]


def by_config(recs, metric: str) -> dict:
    """{cell key (qft.record.cell_key): {seed: (ids, scores, test accuracy, run kind, run folder)}} of the trained
    cells among `recs`, scored per `metric`."""
    out: dict = {}
    for run_dir, rec in recs:
        if not (rec.get("trainable_params") or {}).get("total"):
            continue  # an untrained cell has no seed noise: it would shrink the seed component
        key = record.cell_key(rec["config"], rec.get("inputs") or {})
        ids, per_example = scores(run_dir, rec, metric) or (None, None)
        out.setdefault(key, {})[rec["seed"]] = (ids, per_example, float(rec["final_accuracy"]["test"]),
                                                frame.kind_name(frame.record_kind(rec)), run_dir)
    return out


def _paired(a: dict, b: dict) -> list:
    """The seeds cells `a` and `b` share whose two records ran on one run kind, as the report pairs them."""
    return sorted(s for s in set(a) & set(b) if frame.one_kind(a[s][3], b[s][3]))


def refused(configs: dict) -> list[str]:
    """A line naming each pair of records of one seed in two cells of `configs` that ran on different run kinds,
    left out of the components as the report leaves them out of a contrast."""
    return [f"seed {s}: {Path(a[s][4]).name} on {a[s][3]}; {Path(b[s][4]).name} on {b[s][3]}"
            for a, b in itertools.combinations(configs.values(), 2) for s in sorted(set(a) & set(b))
            if not frame.one_kind(a[s][3], b[s][3])]


def components(configs: dict) -> tuple[dict, int, int] | None:
    """(pooled crossed variance components, seeds, examples) over every pair of cells of `configs` sharing seeds and
    examples, each seed's pair on one run kind (a kind's effect then joins the seed component); None without one."""
    pooled, weight, shape = {"seed": 0.0, "example": 0.0, "residual": 0.0}, 0.0, None
    for a, b in itertools.combinations(configs.values(), 2):
        seeds = _paired(a, b)
        if len(seeds) < 2 or any(a[s][0] is None or b[s][0] is None for s in seeds):
            continue
        ids = a[seeds[0]][0]
        if any(not np.array_equal(x[s][0], ids) for x in (a, b) for s in seeds):
            continue
        d = np.stack([a[s][1] - b[s][1] for s in seeds])
        _, _, _, comp = stats.crossed(d)
        w = (len(seeds) - 1) * (len(ids) - 1)
        for k in pooled:
            pooled[k] += w * comp[k]
        weight += w
        shape = (len(seeds), len(ids))
    if not weight:
        return None
    return {k: v / weight for k, v in pooled.items()}, shape[0], shape[1]


def seeds_needed(comp: dict, examples: int, want, alpha: float) -> int | None:
    """The fewest seeds (2 to MAX_SEEDS) at which `want(se, df, alpha)`, a power function, reaches 0.8 with
    components `comp` and `examples`; None beyond."""
    for s in range(2, MAX_SEEDS + 1):
        se, df = stats.design_se(comp, s, examples), stats.design_df(comp, s, examples)
        if want(se, df, alpha) >= 0.8:
            return s
    return None


def simulated_power(comp: dict, seeds: int, examples: int, delta: float, alpha: float, studies: int) -> float:
    """The share of `studies` simulated studies (`seeds` x `examples`, normal effects with components `comp`) in
    which stats.paired finds true difference `delta` at level `alpha`; a fixed stream, so a fixed answer."""
    rng = np.random.default_rng(20261204)
    sd = {k: math.sqrt(comp[k]) for k in ("seed", "example", "residual")}
    found = 0
    for _ in range(studies):
        d = (delta + rng.normal(0, sd["seed"], (seeds, 1)) + rng.normal(0, sd["example"], (1, examples))
             + rng.normal(0, sd["residual"], (seeds, examples)))
        found += stats.paired(d, np.zeros_like(d)).p < alpha
    return found / studies


def hours_per_run(recs, cpu_kind: str | None) -> tuple[float | None, float | None, str]:
    """(seconds of one run's training, seconds to score one example, a note of the source) from the records of
    `recs` made on `cpu_kind`, or from all of them where none was (rough, the note says)."""
    same = [r for _, r in recs if (r.get("execution") or {}).get("cpu_kind") == cpu_kind]
    note = f"from {len(same)} records made on this CPU kind ({cpu_kind})"
    if not same:
        same, note = [r for _, r in recs], f"from records made on another CPU kind than this one ({cpu_kind}): rough"
    train_s = np.mean([r.get("train_seconds") or 0 for r in same])
    # a resumed run's training seconds sum its invocations, its wall seconds are the last one's: no scoring time there
    whole = [r for r in same if not r.get("execution_history")] or same
    rest = [(r.get("wall_seconds") or 0) - (r.get("train_seconds") or 0) for r in whole]
    scored = [sum((r.get("data") or {}).get("sizes", {}).get(s, 0) for s in ("val", "test")) or 1 for r in whole]
    per_example = max(0.0, float(np.mean([x / n for x, n in zip(rest, scored)])))
    return float(train_s), per_example, note


def plan(paths, delta: float, margin: float, alpha: float, family: int, cells: int | None, metric: str,
         sizes=SIZES, simulate: int | None = None, studies: int = 400) -> str:
    """The power table for the records at `paths`: seeds to find `delta` and to show equivalence within `margin` at
    `alpha` / `family`, per test size in `sizes`, for `cells` configurations (default: the records'), per `metric`;
    with `simulate` seeds, `studies` simulated studies of the report's own test."""
    recs = runs(paths)
    configs = by_config(recs, metric)
    cells = cells or max(len(configs), 1)
    a = alpha / max(family, 1)
    kind = record.cpu_kind()[1]
    train_s, per_ex, note = hours_per_run(recs, kind)
    val = int(np.median([(r.get("data") or {}).get("sizes", {}).get("val", 0) for _, r in recs]))
    lines = [f"qft.tools.power: {len(recs)} ok records, {len(configs)} trained configurations; metric {metric}; "
             f"delta {delta:g}, equivalence margin ±{margin:g}, alpha {alpha:g} over a family of {family} "
             f"(planned at {a:.3g} each), 80% power; {cells} cells"]
    kinds = sorted({v[3] for c in configs.values() for v in c.values()})
    if len(kinds) > 1:
        lines.append(f"records of {len(kinds)} run kinds ({' / '.join(kinds)}): pairs (two cells of one seed) pool "
                     "across kinds, each pair on one kind")
    left = refused(configs)
    if left:
        lines.append(f"left out, their two cells on different run kinds: {len(left)} pairs ({'; '.join(left)})")
    comp = components(configs)
    if comp is None:
        by_kind: dict = {}  # a cell's seeds on one kind: the seed-to-seed spread without the kinds' differences
        for key, c in configs.items():
            for v in c.values():
                by_kind.setdefault((key, v[3]), []).append(v[2])
        acc = [x for x in by_kind.values() if len(x) >= 2]
        if not acc:
            raise QftError("RECORDS", " ".join(map(str, paths)), "needs at least two seeds of one configuration on "
                           "one run kind")
        sd = math.sqrt(np.mean([np.var(x, ddof=1) for x in acc]))
        n_test = int(np.median([(r.get("data") or {}).get("sizes", {}).get("test", 0) for _, r in recs]))
        why = "no per-example scores in these records (made before they were kept)" if not any(
            v[0] is not None for c in configs.values() for v in c.values()) else \
            "no two trained configurations share two seeds with per-example scores, each pair on one run kind"
        lines.append(f"{why}: the seed-to-seed SD of test accuracy is {sd:.4f} at {n_test} test examples, and seed and "
                     f"example noise cannot be told apart; the test size stays {n_test}.")
        comp_w = {"seed": 2 * sd * sd, "example": 0.0, "residual": 0.0, "unpaired": True}  # both sides' variance
        sizes = (n_test,)
        comp = comp_w
    else:
        comp, s0, n0 = comp
        lines.append(f"paired variance components of a difference, from {s0} seeds x {n0} examples: seed "
                     f"{comp['seed']:.3g}, example {comp['example']:.3g}, residual {comp['residual']:.3g} (SE of the "
                     f"paired mean difference at the pilot's size: {stats.design_se(comp, s0, n0):.4f})")
    lines += ["", "| test examples | SE at 3 seeds | smallest difference 3 seeds find (80%) | seeds to find "
              f"{delta:g} | seeds to show ±{margin:g} | hours (find) | hours (equivalence) |", "|---|---|---|---|---|---|---|"]
    for n in sizes:
        se3, df3 = stats.design_se(comp, 3, n), stats.design_df(comp, 3, n)
        mdd = stats.smallest_difference(se3, df3, a)
        find = seeds_needed(comp, n, lambda se, df, al: stats.power_difference(delta, se, df, al), a)
        equiv = seeds_needed(comp, n, lambda se, df, al: stats.power_equivalence(margin, se, df, al), a)

        def hours(s):
            return "-" if s is None else f"{cells * s * (train_s + per_ex * (n + val)) / 3600:.1f}"
        lines.append(f"| {n} | {se3:.4f} | {'>1' if mdd is None else f'{mdd:.3f}'} | "
                     f"{find or f'>{MAX_SEEDS}'} | {equiv or f'>{MAX_SEEDS}'} | {hours(find)} | {hours(equiv)} |")
    lines += ["", f"Hours: cells x seeds x (training {train_s:.0f} s + scoring {per_ex:.2f} s an example), {note}; "
                  "one run at a time on this machine."]
    if simulate:
        if comp.get("unpaired"):
            raise QftError("--simulate", simulate, "records with per-example scores (it simulates the paired test)")
        n = int(n0)
        got = []
        for scale in SEED_SCALES:  # the seed component rests on few degrees of freedom: how much it matters
            c = {**comp, "seed": comp["seed"] * scale}
            se, df = stats.design_se(c, simulate, n), stats.design_df(c, simulate, n)
            got.append(f"seed component x{scale}: {simulated_power(c, simulate, n, delta, a, studies):.2f} "
                       f"(the t above: {stats.power_difference(delta, se, df, a):.2f})")
        lines += ["", f"Simulated power of the report's own test (generalized interval) to find {delta:g} at {a:.3g}, "
                      f"{simulate} seeds x {n} examples, {studies} studies (binomial SE up to "
                      f"{0.5 / math.sqrt(studies):.3f}): " + "; ".join(got) + "."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    ap = argparse.ArgumentParser(prog="python -m qft.tools.power", description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="folders of pilot result records")
    ap.add_argument("--delta", type=float, default=0.02, help="the difference to find (default 0.02)")
    ap.add_argument("--margin", type=float, default=None, help="the equivalence margin (default: delta)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--family", type=int, default=1, help="comparisons in the declared family (Bonferroni share)")
    ap.add_argument("--cells", type=int, default=None, help="configurations the study runs (default: the records')")
    ap.add_argument("--metric", choices=("accuracy", "loglik"), default="accuracy",
                    help="per-example correctness, or the gold label's log-likelihood (continuous, more power)")
    ap.add_argument("--simulate", type=int, default=None, metavar="SEEDS",
                    help="also simulate the report's own test at this many seeds and the records' test size, with the "
                         "seed component as estimated and at 2x and 4x it")
    ap.add_argument("--studies", type=int, default=400, help="simulated studies for --simulate (default 400)")
    return ap


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 on bad input)."""
    args = parser().parse_args(argv)
    try:
        for key, v in (("--delta", args.delta), ("--alpha", args.alpha)):
            if not v > 0:
                raise QftError(key, v, "a number > 0")
        if args.family < 1:
            raise QftError("--family", args.family, "an integer >= 1")
        if args.simulate is not None and args.simulate < 2:
            raise QftError("--simulate", args.simulate, "an integer >= 2 (seeds)")
        if args.studies < 1:
            raise QftError("--studies", args.studies, "an integer >= 1")
        print(plan(args.records, args.delta, args.margin or args.delta, args.alpha, args.family, args.cells,
                   args.metric, simulate=args.simulate, studies=args.studies))
    except QftError as e:
        return fail("qft.tools.power", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
