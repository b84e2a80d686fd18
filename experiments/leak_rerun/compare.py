"""Old (data format 1, prompts whose length told the label) against new (format 2) rank_sweep test accuracy on
Reuters R8, per cell and seed: `python experiments/leak_rerun/compare.py` prints the table and writes comparison.md.

The two sides differ in more than the prompt budget: format 2 drops training items whose prompt equals a test
prompt, which redrew the splits (131 of 200 test, 1 of 50 validation and 1,000 of 1,600 training examples shared),
and the old records ran on a 2-core Intel Xeon with AMX, the new ones on the CPU named in their records, with another
transformers version and qft code; both computed in bf16. So old - new measures the fix together with the data, the
machine and the code; it is a per-seed comparison, not a paired one, and no estimate of the leak alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = ROOT / "results/rank_sweep/runs", ROOT / "results/rank_sweep_r8_format2/runs"


def table(folder: Path) -> pd.DataFrame:
    rows = []
    for f in folder.glob("*data=reuters_r8*/result.json"):
        r = json.loads(f.read_text())
        if r.get("status") != "ok":
            continue
        c = r["config"]
        rows.append({"attn_r": c["adapter"]["attn"]["r"], "mlp_r": c["adapter"]["mlp"]["r"], "seed": r["seed"],
                     "acc": r["final_accuracy"]["test"], "cpu": (r.get("execution") or {}).get("cpu_kind", "amx_bf16 (old)"),
                     "dtype": c["quant"]["compute_dtype"]})
    return pd.DataFrame(rows)


def main() -> str:
    old, new = table(OLD), table(NEW)
    both = old.merge(new, on=["attn_r", "mlp_r", "seed"], suffixes=("_old", "_new"))
    both["new_minus_old"] = both.acc_new - both.acc_old
    both = both.sort_values(["attn_r", "mlp_r", "seed"])
    d = both.new_minus_old.to_numpy()
    lines = ["| attn r | mlp r | seed | old (format 1) | new (format 2) | new - old |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.attn_r} | {r.mlp_r} | {r.seed} | {r.acc_old:.3f} | {r.acc_new:.3f} | {r.new_minus_old:+.3f} |"
              for r in both.itertuples()]
    trained = both[(both.attn_r > 0) | (both.mlp_r > 0)].new_minus_old.to_numpy()
    out = "\n".join(lines) + "\n\n"
    out += f"{len(both)} cell-seed pairs (old: {sorted(set(old.cpu))}, {sorted(set(old.dtype))}; new: {sorted(set(new.cpu))}, " \
           f"{sorted(set(new.dtype))}).\n"
    if len(trained) >= 2:
        ci = stats.ttest_1samp(trained, 0.0).confidence_interval(0.95)
        out += (f"Trained cells: mean new - old {trained.mean():+.4f}, 95% t interval [{ci.low:+.4f}, {ci.high:+.4f}] "
                f"over {len(trained)} pairs (pairs treated as independent: cells share seeds, so the interval is "
                f"optimistic); mean |new - old| {np.abs(trained).mean():.4f}.\n")
    return out


if __name__ == "__main__":
    text = main()
    (Path(__file__).parent / "comparison.md").write_text(text)
    print(text)
