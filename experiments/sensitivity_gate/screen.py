"""The gate's tables (plan.yaml). The screen (stages 1, 2 and 4): for each declared candidate, the all-module cut
from the top rank to rank 1 in test accuracy, paired by document within SmolLM2-135M's seed 0, its two-sided 90%
interval (paired t over the documents) and the declared rule's verdict; beside it the run kind of each cell (a pair
must share one) and the validation curves (the plateau). The confirmation (stage 3, amendment of 2026-12-07 08:20 UTC): per
candidate and model family, the same cut over seeds 1-3 x documents with qft.stats.generalized at 90%, the rule's
verdict, the cut in class-balanced accuracy (described only) and each cell's mean test accuracy. From the repository
root:

    python experiments/sensitivity_gate/screen.py [results/sensitivity_gate/runs] > experiments/sensitivity_gate/screen.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml
from scipy import stats

from qft import frame, record
from qft.stats import generalized
from qft.tools.power import runs

HERE = Path(__file__).parent
SCREEN_MODEL, SCREEN_SEEDS = "smollm2_135m", (0,)


def candidate_of(rec: dict, candidates: list) -> str | None:
    """The declared candidate whose data and training settings the record's config carries (a declaration without
    `train` is the protocol's 250 steps; None: a record of no candidate)."""
    config = rec["config"]
    for c in candidates:
        declared = {"data": c["data"], "train": c.get("train", {"steps": 250})}
        if all(config[group].get(k) == v for group, keys in declared.items() for k, v in keys.items()):
            return c["name"]
    return None


def cut(top, low, level: float = 0.90) -> dict:
    """top - low in accuracy over the documents both cells scored: mean, paired-t interval, discordant share."""
    a, b, _ = aligned([(top, low)])
    d = a[0] - b[0]
    if not d.any():
        return {"diff": 0.0, "lo": 0.0, "hi": 0.0, "n": len(d), "discordant": 0.0}
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(level)
    return {"diff": d.mean(), "lo": ci.low, "hi": ci.high, "n": len(d), "discordant": float((d != 0).mean())}


def main(argv: list[str]) -> int:
    plan = yaml.safe_load((HERE / "plan.yaml").read_text())
    folder = argv[0] if argv else "results/sensitivity_gate/runs"
    rule = plan["rule"]
    candidates = plan["candidates"] + plan.get("candidates_amended", []) + plan.get("candidates_harder", [])
    cells: dict = {}
    for run_dir, rec in runs([folder]):  # every ok record, of any run kind (checked pair by pair below)
        name = candidate_of(rec, candidates)
        a = rec["config"]["adapter"]
        ex = (record.read_examples(run_dir, rec) or {}).get("final.test")
        if name is None or ex is None:
            continue
        key = (name, rec["config"]["model"]["name"], a["attn"]["r"], a["mlp"]["r"], rec["seed"])
        cells[key] = (rec, (ex["id"], ex["correct"], ex["gold"]))
    print("| candidate | cut | seed | top acc | rank-1 acc | top - rank 1 [90%] | test documents (discordant) | train / val | "
          "rule | run kind | validation accuracy at steps 50, 100, ...: top cell / rank 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    passed_at: dict = {}  # candidate -> the top rank whose cut passed the screen (stage 3 confirms that cut)
    for c in candidates:
        if c.get("void"):
            print(f"| {c['name']} | void | | | | | | | | {c['void']} | |")
            continue
        for top in (8, 32):
            for seed in SCREEN_SEEDS:
                hi, lo = cells.get((c["name"], SCREEN_MODEL, top, top, seed)), cells.get((c["name"], SCREEN_MODEL, 1, 1, seed))
                if not hi or not lo:
                    continue
                kinds = {frame.record_kind(hi[0]), frame.record_kind(lo[0])}
                if len(kinds) > 1:
                    print(f"| {c['name']} | {top} -> 1 | {seed} | | | cells ran on different kinds: "
                          f"{' / '.join(map(str, kinds))}; not a pair | | | | | |")
                    continue
                r = cut(hi, lo)
                sizes = hi[0]["data"]["sizes"]
                passed = r["diff"] >= rule["cut_at_least"] and r["lo"] > rule["lower_90_above"]
                if passed:
                    passed_at.setdefault(c["name"], top)
                curve = " / ".join(" ".join(f"{v:.3f}" for _, v in (cell[0].get("val_curve") or [])) for cell in (hi, lo))
                print(f"| {c['name']} | {top} -> 1 | {seed} | {hi[0]['final_accuracy']['test']:.4f} | "
                      f"{lo[0]['final_accuracy']['test']:.4f} | {r['diff']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
                      f"{r['n']} ({r['discordant']:.3f}) | {sizes['train']} / {sizes['val']} | {'passes' if passed else 'fails'} | {kinds.pop()} | "
                      f"{curve} |")
    confirm(plan, cells, passed_at)
    return 0


def aligned(pairs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seeds x documents) correctness of the top and rank-1 cells of each pair, documents in id order, and the gold
    labels; refuses runs that scored different test documents (the amendment varies split_seed only where the test
    documents stay the same)."""
    ids = [np.asarray(x[1][0]) for pair in pairs for x in pair]
    common = ids[0]
    for i in ids[1:]:
        common = np.intersect1d(common, i)
    if any(len(i) != len(common) for i in ids):
        raise ValueError(f"the runs scored different test documents ({sorted({len(i) for i in ids})}, "
                         f"{len(common)} shared)")
    rows = []
    for pair in pairs:
        rows.append([x[1][1][np.argsort(x[1][0])].astype(float) for x in pair])
    gold = pairs[0][0][1][2][np.argsort(pairs[0][0][1][0])]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), gold


def confirm(plan: dict, cells: dict, passed_at: dict) -> None:
    """Stage 3's table: the rule on seeds x documents per candidate and family, on the cut that passed its screen
    (`passed_at`: 8 -> 1 after stage 1; 32 -> 1, with (32, 32) in place of (16, 16), after stages 2 and 4), and the
    curve over rank."""
    seeds, rule = plan["confirm_seeds_amended"], plan["rule"]
    names = sorted({(k[0], k[1]) for k in cells if k[4] in seeds and k[0] in passed_at})
    if not names:
        return
    print()
    print("| candidate | model | cut | seeds (pairs) | top - 1 [90%, generalized] | rule | class-balanced top - 1 [90%] | "
          "mean test accuracy by rank (seeds) | run kinds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model in names:
        top = passed_at[name]
        ranks = [c["attn_r"] for c in plan["confirm_cells_amended"]]
        ranks = ranks if top == 8 else [r for r in ranks if r != 16] + [top]
        pairs, kinds, straddled = [], set(), []
        for seed in seeds:
            hi, lo = cells.get((name, model, top, top, seed)), cells.get((name, model, 1, 1, seed))
            if not hi or not lo:
                continue
            k = {frame.record_kind(hi[0]), frame.record_kind(lo[0])}
            if len(k) > 1:
                straddled.append(seed)
                continue
            kinds |= k
            pairs.append((hi, lo))
        curve = []
        for r in ranks:
            acc = [cells[(name, model, r, r, s)][0]["final_accuracy"]["test"] for s in seeds if (name, model, r, r, s) in cells]
            curve.append(f"{r}: {np.mean(acc):.4f} ({len(acc)})" if acc else f"{r}: -")
        got = f"{len(pairs)} of {len(seeds)}" + (f"; seeds {straddled} straddle kinds, not pairs" if straddled else "")
        if len(pairs) < 2:
            print(f"| {name} | {model} | {top} -> 1 | {got} | | pending | | {', '.join(curve)} | {' / '.join(map(str, kinds))} |")
            continue
        high, low, gold = aligned(pairs)
        d = high - low
        lo90, hi90, *_ = generalized(d, rule["lower_90_above"], level=0.90)
        labels, counts = np.unique(gold, return_counts=True)
        weight = len(gold) / (len(labels) * counts[np.searchsorted(labels, gold)])
        blo, bhi, *_ = generalized(d * weight, rule["lower_90_above"], level=0.90)
        passed = d.mean() >= rule["cut_at_least"] and lo90 > rule["lower_90_above"]
        verdict = ("passes" if passed else "fails") if len(pairs) == len(seeds) else "pending"
        print(f"| {name} | {model} | {top} -> 1 | {got} ({d.shape[1]} documents) | {d.mean():+.4f} [{lo90:+.4f}, {hi90:+.4f}] | "
              f"{verdict} | {(d * weight).mean():+.4f} [{blo:+.4f}, {bhi:+.4f}] | {', '.join(curve)} | "
              f"{' / '.join(map(str, kinds))} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
