"""finding1_ng20's seed rule, as its plans declare it, from the gate's stage-3 records of ng20 (also the rule of
finding3_ng20 and finding2_ng20, each at its own --family): per model family f, M_f (a quarter of the mean 32 -> 1
cut over seeds 1-3), the power tool's own output on exactly f's six records (cells (32, 32) and (1, 1), seeds 1-3)
and n_f (the larger of its "seeds to find" and "seeds to show" on the 2000 row); then n = max(n_1, n_2, 3) and h
(the mean wall hours of the records made in one invocation). It refuses, exit 2, until all twelve records exist.

    python experiments/finding1_ng20/seeds.py --family 3 > experiments/finding1_ng20/power.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FAMILIES = ("smollm2_135m", "gemma3_270m")
RANKS = (32, 1)
SEEDS = (1, 2, 3)
COMMIT, THREADS = "b8e49f7", 2  # the stage-3 checkout and thread count (the gate's note of 2026-12-07 16:17 UTC)
REGIME = {"source": "twenty_newsgroups", "max_length": 256, "train_size": 4000, "val_size": 200, "test_size": 2000,
          "test_stream": "own", "split_seed": 0}


def stage3(runs: Path) -> dict:
    """{(family, rank, seed): (folder, record)} of the ok stage-3 ng20 records under `runs`: the regime's data, rank r
    on both module types, 250 steps, NF4, qft COMMIT at THREADS threads."""
    out = {}
    for path in sorted(runs.glob("*/result.json")):
        rec = json.loads(path.read_text())
        c, e = rec.get("config") or {}, rec.get("execution") or {}
        a = c.get("adapter") or {}
        r = (a.get("attn") or {}).get("r")
        key = ((c.get("model") or {}).get("name"), r, rec.get("seed"))
        if (rec.get("status") == "ok" and all((c.get("data") or {}).get(k) == v for k, v in REGIME.items())
                and r == (a.get("mlp") or {}).get("r") and (c.get("train") or {}).get("steps") == 250
                and ((c.get("quant") or {}).get("attn") or {}).get("quant_type") == "nf4"
                and str(e.get("qft_commit", "")).startswith(COMMIT) and e.get("threads") == THREADS
                and key[0] in FAMILIES and r in RANKS and key[2] in SEEDS):
            out[key] = (path.parent, rec)
    return out


def seeds_column(text: str, rows: int = 2000) -> tuple[int | None, int | None]:
    """(seeds to find, seeds to show) on the `rows` row of the power tool's table `text`; None where it says >N."""
    for line in text.splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if cells and cells[0] == str(rows):
            return tuple(None if x.startswith(">") else int(x) for x in cells[3:5])
    raise ValueError(f"the power tool printed no row for {rows} test examples")


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 until the twelve records exist)."""
    ap = argparse.ArgumentParser(prog="python experiments/finding1_ng20/seeds.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", type=int, required=True,
                    help="contrasts in the Holm family: finding1_ng20 3, finding3_ng20 2, finding2_ng20 k")
    ap.add_argument("--runs", default="results/sensitivity_gate/runs", help="the gate's record folder")
    args = ap.parse_args(argv)
    found = stage3(Path(args.runs))
    missing = [f"{f} ({r}, {r}) seed {s}" for f in FAMILIES for r in RANKS for s in SEEDS if (f, r, s) not in found]
    if missing:
        print(f"seeds.py: error: --runs={args.runs}: stage 3 lacks {len(missing)} of its 12 records: "
              f"{', '.join(missing)}", file=sys.stderr)
        return 2
    counts = []
    for f in FAMILIES:
        cut = sum(found[(f, 32, s)][1]["final_accuracy"]["test"] - found[(f, 1, s)][1]["final_accuracy"]["test"]
                  for s in SEEDS) / len(SEEDS)
        delta = 0.25 * cut
        folders = [str(found[(f, r, s)][0]) for r in RANKS for s in SEEDS]
        command = ["-m", "qft.tools.power", *folders, "--delta", f"{delta:.6f}", "--family", str(args.family)]
        got = subprocess.run([sys.executable, *command], capture_output=True, text=True, check=True).stdout
        find, show = seeds_column(got)
        n_f = None if find is None or show is None else max(find, show)
        counts.append(n_f)
        print(f"## {f}\n\nmean 32 -> 1 cut over seeds 1-3: {cut:+.4f}; M = 0.25 x that = {delta:.6f}\n\n"
              f"$ python {' '.join(command)}\n{got}\nn_{f} = {n_f if n_f is not None else '>100 (left to the budget)'}"
              "\n")
    n = None if None in counts else max(*counts, 3)
    whole = [rec for _, rec in found.values() if not rec.get("execution_history")]
    h = sum(rec["wall_seconds"] for rec in whole) / len(whole) / 3600
    print(f"n = max(n_1, n_2, 3) = {n if n is not None else '>100: left to the budget'}; h = {h:.3f} hours (the mean "
          f"wall_seconds of the {len(whole)} of 12 records made in one invocation)")
    if n is not None and args.family == 3:
        print(f"finding1_ng20: hours(n) = 2 x (4 x {n} - 6) x h = {2 * (4 * n - 6) * h:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
