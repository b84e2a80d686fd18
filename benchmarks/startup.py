"""Where a later run's start-up inside a sweep goes; with --against, the same for another checkout, alternating.

    python benchmarks/startup.py                               # this checkout: 3 processes of 4 later runs each
    python benchmarks/startup.py --against ../old --pairs 4   # alternating with a worktree of another commit

Each process runs one short fine-tune (imports paid, model converted, data and quantized base cached), then `--probes`
later runs the way a sweep's basic launcher runs them: the collector frozen (`qft.train.freeze_survivors`), the config
composed, `qft.run.run` until its training loop begins. Each probe's start-up is timed, and within it the qft
functions `run.run` calls. The workload is speed.py's (SmolLM2-135M, BBC News, NF4, r=8 on all 7 projections, batch
16 x 64). Medians and, with --against, this checkout's over the other's per pair go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the functions of a start-up's parts, as run.run and run.build call them (module, function); a module named
# "new|old" is the first of them the tree has, so a checkout from before code moved is timed alike
PARTS = {"validate": [("validate", "validate")], "tokenizer": [("model", "load_tokenizer")],
         "data": [("data", "prepare")], "load": [("model", "load")], "quantize": [("quant", "quantize")],
         "adapters (peft)": [("adapter", "attach")],
         "switches": [("accel.masks|adapter", "compile_masks"), ("accel.rope|model", "compile_rope"),
                      ("accel.fuse|fuse", "install"), ("accel.fuse|fuse", "compile_sums"),
                      ("accel.fuse|fuse", "split_rows")]}


def _module(names: str, function: str):
    """The first of the qft modules `names` ("a|b") that this tree has and that holds `function`."""
    import importlib

    for name in names.split("|"):
        try:
            module = importlib.import_module(f"qft.{name}")
        except ModuleNotFoundError:
            continue
        if hasattr(module, function):
            return module
    raise ModuleNotFoundError(f"none of qft.{names.replace('|', ', qft.')} holds {function}")


def child(a) -> None:
    """In this process, with qft imported from `a.tree`: one run, then the probes; their timings as JSON on stdout."""
    sys.path[:0] = [str(Path(a.tree).resolve()), str(HERE)]
    import speed
    from qft import run, train

    spent: dict[str, float] = {}
    for part, funcs in PARTS.items():
        for mod, name in funcs:
            m = _module(mod, name)
            f = getattr(m, name)

            def timed(*x, _f=f, _part=part, **k):
                t = time.perf_counter()
                try:
                    return _f(*x, **k)
                finally:
                    spent[_part] = spent.get(_part, 0.0) + time.perf_counter() - t
            setattr(m, name, timed)
    spec = argparse.Namespace(steps=2, batch=16, seq=64, test=10, qft_overrides=a.qft_overrides)
    first = run.run(speed.compose(spec), Path(a.workdir) / "first")
    probes = []
    for i in range(a.probes):
        train.freeze_survivors()
        spent.clear()
        t0 = time.perf_counter()
        cfg = speed.compose(spec)
        composed = time.perf_counter() - t0
        speed.until_training(cfg, Path(a.workdir) / f"probe{i}")
        total = time.perf_counter() - t0
        parts = {"compose": composed, **{p: spent.get(p, 0.0) for p in PARTS}}
        probes.append({"total": total, **parts, "other": total - sum(parts.values())})
    code = {k: first["execution"].get(k) for k in ("qft_commit", "qft_edited", "qft_source")}
    print(json.dumps({"code": code, "probes": probes}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="DIR", help="another checkout (e.g. a git worktree) to alternate with")
    ap.add_argument("--pairs", type=int, default=3, help="processes per checkout, alternating")
    ap.add_argument("--probes", type=int, default=4, help="later runs timed in each process")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("qft_overrides", nargs="*", help="qft overrides, e.g. quant.compute_dtype=fp32")
    a = ap.parse_args()
    if a.child:
        try:
            return child(a)
        except Exception as e:  # a refused config: QftError (imported from the tree the child runs)
            if type(e).__name__ != "QftError":
                raise
            raise SystemExit(print(f"startup.py: error: {e}", file=sys.stderr) or 2)
    if a.pairs < 1 or a.probes < 1:
        ap.error("--pairs and --probes must be at least 1")
    if a.against and not (Path(a.against) / "qft" / "run.py").is_file():
        ap.error(f"--against {a.against}: not a qft checkout (no qft/run.py)")
    sys.path.insert(0, str(HERE))
    import tempfile

    import speed

    trees = {"this": str(ROOT), **({"against": str(Path(a.against).resolve())} if a.against else {})}
    runs, code = {k: [] for k in trees}, {}  # code: each checkout's qft commit, edits and source digest
    with tempfile.TemporaryDirectory(prefix="qft-startup-") as work:
        for rep in range(a.pairs):
            for kind, tree in trees.items():
                p = subprocess.run([sys.executable, __file__, "--child", "--tree", tree, "--probes", str(a.probes),
                                    "--workdir", f"{work}/{kind}-{rep}", "sweep.force=true", *a.qft_overrides],
                                   cwd=tree, capture_output=True, text=True)
                if p.returncode == 2:  # the child's one-line error
                    raise SystemExit(print(p.stderr.strip().splitlines()[-1], file=sys.stderr) or 2)
                if p.returncode:
                    raise SystemExit(f"startup.py: {kind} ({tree}) failed:\n{p.stderr[-3000:]}")
                got = json.loads(p.stdout.strip().splitlines()[-1])
                runs[kind].append(got["probes"])
                code.setdefault(kind, got["code"])
    where = speed.machine()
    names = ["total", "compose", *PARTS, "other"]
    med = {k: {n: statistics.median(pr[n] for proc in v for pr in proc) for n in names} for k, v in runs.items()}
    # the record names each checkout relative to this one (its commit is under "code"), no path of this machine
    named = {k: os.path.relpath(t, ROOT) for k, t in trees.items()}
    out = {"settings": {**where, "pairs": a.pairs, "probes": a.probes, "overrides": a.qft_overrides, "trees": named,
                        "code": code},
           "median_seconds": med, "runs": runs}
    print(f"{where['cpu']} ({where['cpu_kind']}), {where['threads']} threads; median of {a.pairs} x {a.probes} probes, "
          "seconds")
    print("| part | " + " | ".join(trees) + " |\n|---|" + "---:|" * len(trees))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{med[k][n]:.3f}" for k in trees) + " |")
    if a.against:  # each pair's processes ran next to each other: the host's pace is shared within a pair
        ratios = [statistics.median(p["total"] for p in mine) / statistics.median(p["total"] for p in theirs)
                  for mine, theirs in zip(runs["this"], runs["against"])]
        out["pair_ratios"] = ratios
        print(f"this / against, start-up: {med['this']['total'] / med['against']['total']:.3f} "
              f"(each pair: {', '.join(f'{r:.3f}' for r in ratios)})")
    name = speed.tagged("startup" + ("-against" if a.against else ""), a.qft_overrides, where["cpu_kind"],
                        where["isa_caps"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {Path(a.out) / name}.json")


if __name__ == "__main__":
    main()
