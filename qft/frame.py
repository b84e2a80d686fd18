"""Result records into one pandas frame, a row a run (`collect`): every table, plot and comparison of
qft.tools.report, and budget.method=fitted, reads the records through it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qft.record import RECORD, cell_key, config_hash, flatten, read_examples
from qft.schema import loaded

if TYPE_CHECKING:
    import pandas as pd

THIRDS = ("shallow", "middle", "deep")
THIRD_ALPHAS = tuple(f"{t}_alpha" for t in THIRDS)
# the config keys a layer-sensitivity study varies, and their short column names
AXES = {"adapter.attn.r": "attn_r", "adapter.mlp.r": "mlp_r", "adapter.attn.alpha": "attn_alpha",
        "adapter.mlp.alpha": "mlp_alpha", "quant.attn.bits": "attn_bits", "quant.mlp.bits": "mlp_bits",
        "budget.params": "budget", "budget.shares": "budget_shares", "budget.method": "budget_method",
        **{f"adapter.depth_groups.{t}.alpha": f"{t}_alpha" for t in THIRDS}}


def row(rec: dict, path: Path) -> dict:
    """The frame's row of record `rec` read from `path`: scores, sizes, run kind, the config's axes (AXES) and every
    config key as `cfg.<key>`, class scores where per-example predictions are kept."""
    params = rec.get("trainable_params") or {}
    per_type = params.get("per_layer_type") or {}
    per_third = params.get("per_depth_group") or {}
    final, zero = rec.get("final_accuracy") or {}, rec.get("zero_shot_accuracy") or {}
    r = {"run_dir": str(path.parent), "status": rec.get("status"), "error": rec.get("error"),
         "config_hash": rec.get("config_hash"), "seed": rec.get("seed"),
         "config_key": config_hash(rec.get("config") or {}, ignore=("seed",), inputs_=rec.get("inputs") or {}),
         "cell_key": cell_key(rec.get("config") or {}, rec.get("inputs") or {}),
         "experiment": (rec.get("config") or {}).get("experiment"),
         "params": params.get("total"), "params_attn": per_type.get("attn"), "params_mlp": per_type.get("mlp"),
         **{f"params_{t}": per_third.get(t) for t in THIRDS},
         "adapted": "+".join(t for t in ("attn", "mlp") if per_type.get(t)) or "none",
         "acc_test": final.get("test"), "acc_val": final.get("val"), "zero_shot_test": zero.get("test"),
         "tokens_per_s": rec.get("train_tokens_per_second"), "peak_rss_bytes": (rec.get("memory") or {}).get("peak_rss_bytes"),
         "wall_seconds": rec.get("wall_seconds"), "base_bytes": (rec.get("base_bytes") or {}).get("total"),
         "cpu_kind": (rec.get("execution") or {}).get("cpu_kind"), "run_kind": record_kind(rec),
         "qft_commit": (rec.get("execution") or {}).get("qft_source") or (rec.get("execution") or {}).get("qft_commit"),
         "has_examples": bool(rec.get("examples")) and (path.parent / rec["examples"]).is_file(),
         "val_curve": rec.get("val_curve") or None, "val_loglik_curve": rec.get("val_loglik_curve") or None}
    flat = flatten(loaded(rec.get("config") or {}))  # an older record's config as it meant it
    for key, short in AXES.items():
        r[short] = flat.get(key)
    for g, v in (rec.get("budget_ranks") or {}).items():  # a budget run's ranks were solved, not configured
        if f"{g}_r" in r:
            r[f"{g}_r"] = v
        else:
            r[f"budget_r_{g}"] = v
    r.update({f"cfg.{k}": v for k, v in flat.items()})
    if r["has_examples"]:
        r.update(class_scores(read_examples(path.parent, rec).get("final.test"), (rec.get("data") or {}).get("labels")))
    return r


def run_kind(execution: dict | None, versions: dict | None = None, history=(), eval_batch: int | None = None
             ) -> str | None:
    """The run kind of a record's `execution`, `versions`, `history` (executions of resumed runs) and `eval_batch`:
    what both records of a pair must share (docs/studies.md, "Run kinds"), as one string; None without execution.

    GPU or CPU (name, id, kind), threads, compute dtype, fusion, pipeline layout, torch version and the evaluation
    batch size where recorded: each can move a result's last bits. A run resumed on another kind names every kind."""
    if not execution:
        return None
    kinds = sorted({_kind(e, versions) for e in [execution, *history]})
    kind = kinds[0] if len(kinds) == 1 else f"{MIXED}: {' + '.join(kinds)}"
    return kind if eval_batch is None else f"{kind}, eval batch {eval_batch}"


MIXED = "mixed within one run"  # a run resumed on another kind: it has no one kind to pair on


def kind_name(kind) -> str:
    """Run kind `kind` as tables print it: None reads "not recorded"."""
    return kind if isinstance(kind, str) else "not recorded"


def one_kind(kind_a, kind_b) -> bool:
    """Whether run kinds `kind_a` and `kind_b` are one kind, as a pair's cells must be: equal and not resumed across
    kinds; two None (no execution recorded) count as one."""
    a, b = kind_name(kind_a), kind_name(kind_b)
    return a == b and not a.startswith(MIXED)


def record_kind(rec: dict) -> str | None:
    """The run kind of record `rec`, its evaluation batch size read from its config (unhashed: no training change)."""
    return run_kind(rec.get("execution"), rec.get("versions"), rec.get("execution_history") or (),
                    (loaded(rec.get("config") or {}).get("train") or {}).get("eval_batch_size"))


def _kind(e: dict, versions: dict | None) -> str:
    """The run kind string of one execution `e` (torch from `versions` where `e` lacks it)."""
    threads = e.get("threads")
    parts = [e.get("cuda") or " ".join(str(x) for x in (e.get("cpu"), e.get("cpu_id"), e.get("cpu_kind")) if x),
             f"{threads} thread{'' if threads == 1 else 's'}", str(e.get("compute_dtype"))]
    if "fuse_projections" in e:
        parts.append("fused" if e["fuse_projections"] else "unfused")
    if e.get("pipeline"):
        stages = " | ".join(f"{a}-{b - 1}" for a, b in e["pipeline"]["layers"])
        parts.append(f"pipeline stages {stages}, {e['pipeline']['micro_batches']} micro-batches")
    torch = e.get("torch") or (versions or {}).get("torch")
    return ", ".join(parts + ([f"torch {torch}"] if torch else []))


def class_scores(t: dict | None, labels: list | None) -> dict:
    """{acc_class_<label>, n_class_<label>, macro_f1_test} from a split's per-example predictions `t` and class
    names `labels`; {} where either is missing. For unbalanced classes (Reuters R8's test split: 49% earnings)."""
    if not t or "pred" not in t or not labels:
        return {}
    gold, pred = t["gold"], t["pred"]
    out, f1 = {}, []
    for c, name in enumerate(labels):
        n_gold, n_pred, tp = int((gold == c).sum()), int((pred == c).sum()), int(((gold == c) & (pred == c)).sum())
        if n_gold == 0:
            continue
        out[f"acc_class_{name}"], out[f"n_class_{name}"] = tp / n_gold, n_gold
        f1.append(2 * tp / (n_gold + n_pred))  # 2 precision recall / (precision + recall)
    out["macro_f1_test"] = float(np.mean(f1)) if f1 else None
    return out


def collect(paths) -> "pd.DataFrame":
    """A frame of row() for every record at or under `paths`; an unreadable one is skipped with a line on stderr."""
    import pandas as pd

    rows = []
    for p in map(Path, paths):
        files = [p] if p.name == RECORD else sorted(p.rglob(RECORD))
        for f in files:
            try:
                rows.append(row(json.loads(f.read_text()), f))
            except (OSError, ValueError) as e:
                print(f"qft.tools.report: skipping unreadable {f}: {e}", file=sys.stderr)
    return pd.DataFrame(rows)
