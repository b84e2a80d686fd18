"""The seed rule of finding1_ng20's plans (finding3_ng20's and finding2_ng20's too, each at its own family size),
from the gate's stage-3 records of ng20: per model family f, M_f (a quarter of the mean 32 -> 1 cut over seeds 1-3),
the power tool's own output on exactly f's six records (cells (32, 32) and (1, 1), seeds 1-3) and n_f (the larger
of its "seeds to find" and "seeds to show" on the 2000 row); n = max(n_1, n_2, 3), h (the mean wall hours of the
records made in one invocation), what the study's plan does with them, and the power tool's --simulate at n
(described only). It writes power_smollm2.txt and power_gemma3.txt (finding2_ng20: power_smollm2_k5.txt and so on,
a k each) to --out, a family each with the common lines after it; it refuses, exit 2, until all twelve records exist.

    python experiments/finding1_ng20/seeds.py --study finding1_ng20 --out experiments/finding1_ng20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qft import record
from qft.errors import QftError
from qft.tools import power

FAMILIES = {"smollm2_135m": "smollm2", "gemma3_270m": "gemma3"}  # model.name: the plans' file name
RANKS = (32, 1)
SEEDS = (1, 2, 3)
COMMIT, THREADS = "b8e49f7", 2  # the stage-3 checkout and thread count (the gate's note of 2026-12-07 16:17 UTC)
REGIME = {"source": "twenty_newsgroups", "max_length": 256, "train_size": 4000, "val_size": 200, "test_size": 2000,
          "test_stream": "own", "split_seed": 0}
STUDIES = {"finding1_ng20": 3, "finding3_ng20": 2, "finding2_ng20": None}  # its Holm family (finding2_ng20: --family)


class Refused(Exception):
    """A one-line reason the rule cannot be applied to these records."""


def stage3(runs: Path) -> dict:
    """{(family, rank, seed): (folder, record)} of the ok stage-3 ng20 records under `runs`: the regime's data, rank r
    on both module types, 250 steps, NF4, qft COMMIT unedited at THREADS threads; Refused where two match one key."""
    out = {}
    if not runs.is_dir():
        raise Refused(f"--runs={runs}: not a folder")
    # the power tool skips a record it cannot read: here it would pass for a missing one
    bad = [f.parent for f in sorted(runs.rglob(record.RECORD)) if not isinstance(record.read(f.parent), dict)]
    if bad:
        raise Refused(f"{bad[0] / record.RECORD} is not a readable record ({len(bad)} such under --runs={runs})")
    try:
        found = power.runs([runs])  # the ok records, read as the power tool reads them
    except QftError:  # the folder is there and every record reads: it holds no ok record yet
        found = []  # the caller names the twelve it lacks
    for folder, rec in found:
        c, e = rec.get("config") or {}, rec.get("execution") or {}
        a = c.get("adapter") or {}
        r = (a.get("attn") or {}).get("r")
        key = ((c.get("model") or {}).get("name"), r, rec.get("seed"))
        if (all((c.get("data") or {}).get(k) == v for k, v in REGIME.items())
                and r == (a.get("mlp") or {}).get("r") and (c.get("train") or {}).get("steps") == 250
                and ((c.get("quant") or {}).get("attn") or {}).get("quant_type") == "nf4"
                and str(e.get("qft_commit", "")).startswith(COMMIT) and e.get("qft_edited") is False
                and e.get("threads") == THREADS and key[0] in FAMILIES and r in RANKS and key[2] in SEEDS):
            if key in out:
                raise Refused(f"two records of {key[0]} ({r}, {r}) seed {key[2]}: {out[key][0]} and {folder}")
            out[key] = (folder, rec)
    return out


def seeds_column(text: str, rows: int = 2000) -> tuple[int | None, int | None]:
    """(seeds to find, seeds to show) on the `rows` row of the power tool's table `text`; None where it says >N."""
    for line in text.splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if cells and cells[0] == str(rows):
            return tuple(None if x.startswith(">") else int(x) for x in cells[3:5])
    raise ValueError(f"the power tool printed no row for {rows} test examples")


def table(folders: list[str], delta: float, family: int, simulate: int | None = None) -> tuple[str, str]:
    """(the command line, the power tool's output, as that line prints it) on `folders` at `delta` (to 6 decimals,
    as the line shows it) and `family` (and `simulate` seeds)."""
    shown = f"{delta:.6f}"
    line = " ".join(["$ python -m qft.tools.power", *folders, "--delta", shown, "--family", str(family),
                     *(["--simulate", str(simulate)] if simulate else [])])
    got = power.plan(folders, float(shown), float(shown), 0.05, family, None, "accuracy", simulate=simulate)
    return line, got + "\n"


def rule(study: str, family: int, found: dict) -> tuple[dict[str, str], str]:
    """({file name: text}, the common lines) of the seed rule of `study` at `family` on the stage-3 records
    `found`."""
    sections, counts, deltas, folders = {}, [], {}, {}
    for f, short in FAMILIES.items():
        cut = sum(found[(f, 32, s)][1]["final_accuracy"]["test"] - found[(f, 1, s)][1]["final_accuracy"]["test"]
                  for s in SEEDS) / len(SEEDS)
        if cut <= 0:
            raise Refused(f"{f}'s mean 32 -> 1 cut over seeds 1-3 is {cut:+.4f}: no margin to size seeds for")
        deltas[f], folders[f] = 0.25 * cut, [str(found[(f, r, s)][0]) for r in RANKS for s in SEEDS]
        command, got = table(folders[f], deltas[f], family)
        find, show = seeds_column(got)
        counts.append(None if find is None or show is None else max(find, show))
        name = f"power_{short}{f'_k{family}' if study == 'finding2_ng20' else ''}.txt"  # finding2_ng20 prices each k
        sections[name] = (f"## {f}\n\nmean 32 -> 1 cut over seeds 1-3: {cut:+.4f}; M = 0.25 x that = "
                                          f"{deltas[f]:.6f}\n\n{command}\n{got}\nn_{f} = "
                                          f"{'>100' if counts[-1] is None else counts[-1]}\n")
    whole = [rec for _, rec in found.values() if not rec.get("execution_history")]
    if not whole:
        raise Refused("every stage-3 record was resumed: no run made in one invocation to give h")
    h = sum(rec["wall_seconds"] for rec in whole) / len(whole) / 3600
    common = [f"h = {h:.3f} hours (the mean wall_seconds of the {len(whole)} of 12 records made in one invocation)"]
    n = None if None in counts else max(*counts, 3)
    if study == "finding1_ng20":
        def hours(k: int) -> float:
            return 2 * (4 * k - 6) * h  # the plan's: two families, 4 cells a seed less the 6 stage-3 runs
        fit = max([k for k in range(3, 101) if hours(k) <= 60] or [3])
        if n is None:
            common.append(f"n: a column reads >100, so n is left to the budget: the largest n with hours(n) = "
                          f"2 x (4n - 6) x h <= 60, never under 3: n = {fit}")
            n = fit
        elif hours(n) > 60:
            common.append(f"n = max(n_1, n_2, 3) = {n}, hours(n) = {hours(n):.1f} > 60: n = the largest with "
                          f"hours(n) <= 60, never under 3: {fit}")
            n = fit
        else:
            common.append(f"n = max(n_1, n_2, 3) = {n}; hours(n) = 2 x (4n - 6) x h = {hours(n):.1f} <= 60")
    elif n is None:
        common.append("a column reads >100: " + ("the study is not run" if study == "finding3_ng20" else
                                                 f"k = {family} does not fit"))
    else:
        common.append(f"n = max(n_1, n_2, 3) = {n}")
    if n is not None:
        for f, name in zip(FAMILIES, sections):  # described only: the seed component rests on 2 degrees of freedom
            command, got = table(folders[f], deltas[f], family, simulate=n)
            sections[name] += f"\nDescribed only, at n = {n}:\n\n{command}\n{got}"
    tail = "\n".join(common) + "\n"
    return {name: text + "\n" + tail for name, text in sections.items()}, tail


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 until the twelve records exist, or on bad input)."""
    ap = argparse.ArgumentParser(prog="python experiments/finding1_ng20/seeds.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", required=True, choices=sorted(STUDIES), help="whose plan's rule (its family size)")
    ap.add_argument("--family", type=int, default=None, help="finding2_ng20's k, the contrasts it keeps (5, 4 or 3)")
    ap.add_argument("--runs", default="results/sensitivity_gate/runs", help="the gate's record folder")
    ap.add_argument("--out", required=True, help="the folder for power_smollm2.txt and power_gemma3.txt")
    args = ap.parse_args(argv)
    family = STUDIES[args.study] or args.family
    try:
        if args.study == "finding2_ng20" and family not in (3, 4, 5):
            raise Refused(f"--family={args.family}: finding2_ng20 keeps 5, 4 or 3 contrasts")
        if args.family not in (None, family):
            raise Refused(f"--family={args.family}: {args.study}'s family is {family}")
        if not Path(args.out).is_dir():
            raise Refused(f"--out={args.out}: not a folder")
        found = stage3(Path(args.runs))
        missing = [f"{f} ({r}, {r}) seed {s}" for f in FAMILIES for r in RANKS for s in SEEDS if (f, r, s) not in found]
        if missing:
            raise Refused(f"--runs={args.runs}: stage 3 lacks {len(missing)} of its 12 records: {', '.join(missing)}")
        files, tail = rule(args.study, family, found)
    except (Refused, QftError) as e:
        print(f"seeds.py: error: {e}", file=sys.stderr)
        return 2
    for name, text in files.items():
        (Path(args.out) / name).write_text(text)
    print(tail, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
