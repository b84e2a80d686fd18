"""Descriptive, for finding 3's write-up: on CPU bitsandbytes trains an int8 base through its dequantized weight and
scores it through LLM.int8 (docs/architecture.md), so an int8 run is scored through a matmul it was not trained
with. This re-scores a run's test split through the training matmul and sets it beside the record's own scores.

    python experiments/finding3/int8_scoring.py [--check] RUN_DIR [RUN_DIR ...]

One line per run: the test accuracy as recorded (LLM.int8) and through the training matmul, their difference, how
many predictions change, and the largest change of a label log-likelihood. `--check` first re-scores through LLM.int8
as the run did and prints how far that lands from the record (the rebuilt model is the one the run scored). No verdict
rests on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from qft import data, evaluate, model, record
from qft.errors import QftError, fail
from qft.quant.int8 import Int8
from qft.tools import predict


def _training_matmul(layer, args) -> None:
    layer.training = True  # Linear8bitLt picks its matmul from self.training at each call


def rescore(run_dir: Path, matmuls=("training",)) -> dict:
    """The run's test split scored as `evaluate.score` scores it, once for each of `matmuls`, with its int8 layers in
    "scoring" (eval mode, LLM.int8, as the run scored) or "training" (train mode, the dequantized weight; dropout stays
    off). The model is built once and serves every pass."""
    net, tokenizer, cfg, _, device = predict.load(run_dir)
    int8 = [m for m in net.modules() if isinstance(m, Int8().modules)]
    if not int8:
        raise QftError("RUN_DIR", str(run_dir), "has no int8 layer (a run with quant=int8, or an int8 layer type)")
    task = data.prepare(cfg.data, tokenizer, cfg.cache_dir)
    dtype = model.compute_dtype(cfg.quant.compute_dtype, device)
    scores = {}
    for matmul in matmuls:
        # label_scores puts the whole model in eval mode; for "training" a hook puts the int8 layers back
        hooks = [m.register_forward_pre_hook(_training_matmul) for m in int8] if matmul == "training" else []
        scores[matmul] = evaluate.score(net, task, "test", tokenizer, cfg.train.eval_batch_size, dtype)["examples"]
        for h in hooks:
            h.remove()
    return scores


def compare(run_dir: Path, check: bool = False) -> dict:
    rec = record.read(run_dir) or {}
    recorded = (record.read_examples(run_dir, rec) or {}).get("final.test")
    if recorded is None:
        raise QftError("RUN_DIR", str(run_dir), "keeps no per-example test scores (examples.npz)")
    scores = rescore(run_dir, ("scoring", "training") if check else ("training",))
    trained, rebuilt = scores["training"], scores.get("scoring")
    if not np.array_equal(trained["id"], recorded["id"]):
        raise QftError("RUN_DIR", str(run_dir), "its test split as rebuilt here differs from the one it recorded")
    return {"n": len(recorded["id"]), "recorded": float(recorded["correct"].mean()),
            "training": float(trained["correct"].mean()),
            "changed": int((trained["pred"] != recorded["pred"]).sum()),
            "max_loglik_change": float(np.abs(trained["loglik"] - recorded["loglik"]).max()),
            "rebuilt_max_loglik_change": None if rebuilt is None else
            float(np.abs(rebuilt["loglik"] - recorded["loglik"]).max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="int8_scoring.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="re-score through LLM.int8 first, against the record")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a finished run of python -m qft with an int8 base")
    args = ap.parse_args(argv)
    try:
        for r in args.runs:
            with torch.no_grad():
                c = compare(Path(r), args.check)
            if args.check:
                print(f"{r}: re-scored through LLM.int8 as the run did, the largest log-likelihood change from the "
                      f"record is {c['rebuilt_max_loglik_change']:.2e}")
            print(f"{r}: n {c['n']}, accuracy as recorded (LLM.int8) {c['recorded']:.4f}, through the training "
                  f"matmul {c['training']:.4f} ({c['training'] - c['recorded']:+.4f}); {c['changed']} predictions "
                  f"change; largest log-likelihood change {c['max_loglik_change']:.3f}")
    except QftError as e:
        return fail("int8_scoring", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
