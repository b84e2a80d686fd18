"""The gate's screen (plan.yaml, stage 1 and 2): for each declared candidate, the all-module cut from the top rank to
rank 1 in test accuracy, paired by document within one seed, its two-sided 90% interval (paired t over the
documents) and the declared rule's verdict; beside it the run kind of each cell (a pair must share one), the
validation curves (the plateau) and the zero-shot floor. From the repository root:

    python experiments/sensitivity_gate/screen.py [results/sensitivity_gate/runs] > experiments/sensitivity_gate/screen.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml
from scipy import stats

from qft import frame, record
from qft.tools.power import runs

HERE = Path(__file__).parent


def candidate_of(rec: dict, candidates: list) -> str | None:
    """The declared candidate whose data settings the record's config carries (None: a record of no candidate)."""
    data = rec["config"]["data"]
    for c in candidates:
        if all(data.get(k) == v for k, v in c["data"].items()):
            return c["name"]
    return None


def cut(top: tuple, low: tuple, level: float = 0.90) -> dict:
    """top - low in accuracy over the documents both scored: mean, paired-t interval, discordant share."""
    (ids_t, ok_t), (ids_l, ok_l) = top, low
    common, it, il = np.intersect1d(ids_t, ids_l, return_indices=True)
    if len(common) != len(ids_t) or len(common) != len(ids_l):
        raise ValueError(f"the pair scored different test documents ({len(ids_t)} and {len(ids_l)}, "
                         f"{len(common)} shared)")
    d = ok_t[it].astype(float) - ok_l[il].astype(float)
    if not d.any():
        return {"diff": 0.0, "lo": 0.0, "hi": 0.0, "n": len(d), "discordant": 0.0}
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(level)
    return {"diff": d.mean(), "lo": ci.low, "hi": ci.high, "n": len(d), "discordant": float((d != 0).mean())}


def main(argv: list[str]) -> int:
    plan = yaml.safe_load((HERE / "plan.yaml").read_text())
    folder = argv[0] if argv else "results/sensitivity_gate/runs"
    rule = plan["rule"]
    candidates = plan["candidates"] + plan.get("candidates_amended", [])
    cells: dict = {}
    for run_dir, rec in runs([folder]):  # every ok record, of any run kind (checked pair by pair below)
        name = candidate_of(rec, candidates)
        a = rec["config"]["adapter"]
        ex = (record.read_examples(run_dir, rec) or {}).get("final.test")
        if name is None or ex is None:
            continue
        cells[(name, a["attn"]["r"], a["mlp"]["r"], rec["seed"])] = (rec, (ex["id"], ex["correct"]))
    print("| candidate | cut | seed | top acc | rank-1 acc | top - rank 1 [90%] | test documents (discordant) | train / val | "
          "rule | run kind | validation accuracy at steps 50, 100, ...: top cell / rank 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in candidates:
        if c.get("void"):
            print(f"| {c['name']} | void | | | | | | | | {c['void']} | |")
            continue
        for top in (8, 32):
            for seed in sorted({k[3] for k in cells if k[0] == c["name"]}):
                hi, lo = cells.get((c["name"], top, top, seed)), cells.get((c["name"], 1, 1, seed))
                if not hi or not lo:
                    continue
                kinds = {frame.record_kind(hi[0]), frame.record_kind(lo[0])}
                if len(kinds) > 1:
                    print(f"| {c['name']} | {top} -> 1 | {seed} | | | cells ran on different kinds: "
                          f"{' / '.join(map(str, kinds))}; not a pair | | | | | |")
                    continue
                r = cut(hi[1], lo[1])
                sizes = hi[0]["data"]["sizes"]
                passed = r["diff"] >= rule["cut_at_least"] and r["lo"] > rule["lower_90_above"]
                curve = " / ".join(" ".join(f"{v:.3f}" for _, v in (cell[0].get("val_curve") or [])) for cell in (hi, lo))
                print(f"| {c['name']} | {top} -> 1 | {seed} | {hi[0]['final_accuracy']['test']:.4f} | "
                      f"{lo[0]['final_accuracy']['test']:.4f} | {r['diff']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
                      f"{r['n']} ({r['discordant']:.3f}) | {sizes['train']} / {sizes['val']} | {'passes' if passed else 'fails'} | {kinds.pop()} | "
                      f"{curve} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
