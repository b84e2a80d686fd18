"""Collect result records into one table and draw the layer-sensitivity plots.

The command line, `python -m qft.tools.report PATH... [--out DIR] [--plan plan.yaml] [--versus ...] [--within ...]`:
a bad argument is one `qft.tools.report: error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qft.tools.report.summary import report


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    ap = argparse.ArgumentParser(prog="python -m qft.tools.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="folders searched for result.json (or result.json files)")
    ap.add_argument("--out", help="output folder (default results/<experiment>)")
    ap.add_argument("--versus", default="", help="the reference configuration, as columns of the table: "
                    "attn_r=8,mlp_r=8 (default: the best configuration)")
    ap.add_argument("--within", default="", help="compare within groups of these columns: attn_bits,mlp_bits")
    ap.add_argument("--plan", help="the study's declared analysis (plan.yaml: contrasts, margin, metric, positive "
                    "controls); its controls and contrasts are printed first with Holm across each, split by run kind; "
                    "the rest is exploratory")
    return ap


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 on bad input)."""
    args = parser().parse_args(argv)
    try:
        versus = dict(kv.split("=", 1) for kv in args.versus.split(",") if kv) or None
    except ValueError:
        print(f"qft.tools.report: error: --versus={args.versus}: COLUMN=VALUE pairs separated by commas", file=sys.stderr)
        return 2
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"qft.tools.report: error: paths={missing}: no such file or folder", file=sys.stderr)
        return 2
    try:
        files = report(args.paths, args.out, versus, tuple(c for c in args.within.split(",") if c), args.plan)
    except ValueError as e:
        print(f"qft.tools.report: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 0
