"""Score new texts with a trained adapter: `python -m qft.tools.predict RUN_DIR texts.csv [--out predictions.csv]`.

The run's record rebuilds what it scored with (base, quantization, saved adapter, prompt frame, label words); each
text is scored as the run's test split was, one row a text: the text, the predicted label word, every label word's
log-likelihood (and, given a label column, the gold label, with the accuracy printed).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from qft import config, data, evaluate, model, record, run, schema
from qft.errors import QftError, fail

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, as `python -m qft` (qft/__main__.py says why)


def read_run(run_dir: Path, classification: bool = True):
    """(record, config) of the ok run in `run_dir` (a `classification` run where asked), the cache set to this
    machine's; raises QftError (RUN_DIR) otherwise."""
    rec = record.read(run_dir)
    if rec is None:
        raise QftError("RUN_DIR", str(run_dir), f"no readable {record.RECORD} there: a run directory of python -m qft")
    if rec.get("status") != "ok" or (classification and (rec.get("data") or {}).get("task") != "classification"):
        raise QftError("RUN_DIR", str(run_dir), f"needs an ok {'classification ' if classification else ''}run (its "
                                                f"record says {rec.get('status')}, task "
                                                f"{(rec.get('data') or {}).get('task')})")
    cfg = OmegaConf.create(schema.loaded(rec["config"]))  # an older record's config as it meant it
    cfg.cache_dir = schema.keys()["cache_dir"].default  # this machine's cache, as a run here resolves it
    return rec, cfg


def adapter_folder(run_dir: Path, rec: dict, name: str) -> Path:
    """The adapter folder holding file `name` of run `rec`: where the record says, else `run_dir`/adapter (a moved
    run directory); raises QftError (RUN_DIR) where neither holds it."""
    for folder in (Path(rec.get("adapter_dir") or run_dir / "adapter"), run_dir / "adapter"):
        if (folder / name).is_file():
            return folder
    raise QftError("RUN_DIR", str(run_dir), f"its adapter/{name} is missing")


def load(run_dir: Path):
    """(model: quantized base + trained adapter, tokenizer, config, label words) of the run in `run_dir`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    rec, cfg = read_run(run_dir)
    device = torch.device(config.device(cfg))
    source = model.resolve(cfg.model, cfg.cache_dir)
    built = run.build(cfg, source, device)
    if built.params["total"]:
        weights = adapter_folder(run_dir, rec, "adapter_model.safetensors") / "adapter_model.safetensors"
        missing = set_peft_model_state_dict(built.model, load_file(str(weights))).unexpected_keys
        if missing:
            raise QftError("RUN_DIR", str(run_dir), f"the saved adapter does not fit the rebuilt model: {missing[:3]}")
    return built.model, model.load_tokenizer(source), cfg, rec["data"]["labels"], device


def predict(run_dir: Path, texts: list[str], batch_size: int = 32) -> tuple[list[str], torch.Tensor, list[str]]:
    """(predicted label words, (n, labels) log-likelihoods) of `texts` under the trained model of `run_dir`, scored in
    batches of `batch_size`."""
    net, tokenizer, cfg, words, device = load(run_dir)
    prompts, label_tokens = data.frame_texts(cfg.data, tokenizer, texts, words)
    scores = evaluate.label_scores(net, prompts, label_tokens, tokenizer.pad_token_id, batch_size,
                                   model.compute_dtype(cfg.quant.compute_dtype, device))
    return [words[i] for i in scores.argmax(1).tolist()], scores.cpu(), words


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 on bad input)."""
    ap = argparse.ArgumentParser(prog="python -m qft.tools.predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory of python -m qft (result.json and adapter/)")
    ap.add_argument("texts", help="a .csv, .tsv, .json or .jsonl file of texts")
    ap.add_argument("--text-column", default=None, help="default: the run's data.text_column, else 'text'")
    ap.add_argument("--label-column", default=None, help="gold labels (as the run's dataset names them), if any")
    ap.add_argument("--out", default=None, help="default: TEXTS with .predictions.csv")
    args = ap.parse_args(argv)
    try:
        run_dir = Path(args.run_dir)
        table = data.read_table(args.texts, "TEXTS")
        rec = record.read(run_dir) or {}
        column = args.text_column or schema.loaded(rec.get("config") or {}).get("data", {}).get("text_column") or "text"
        if column not in table.column_names:
            column = "text" if args.text_column is None and "text" in table.column_names else column
        if column not in table.column_names:
            raise QftError("--text-column", column, f"columns of {args.texts}: {', '.join(table.column_names)}")
        if args.label_column is not None and args.label_column not in table.column_names:
            raise QftError("--label-column", args.label_column, f"columns of {args.texts}: "
                                                                f"{', '.join(table.column_names)}")
        texts = [str(t) for t in table[column]]
        if not texts:
            raise QftError("TEXTS", args.texts, "holds no rows")
        gold = None
        if args.label_column:  # a label the run never saw would be scored as wrong, silently
            mapping = dict(((rec.get("config") or {}).get("data", {}).get("label_words") or {}))
            gold = [str(mapping.get(str(g), g)) for g in table[args.label_column]]
            known = (rec.get("data") or {}).get("labels") or []
            unknown = sorted({g for g in gold if g not in known})
            if known and unknown:
                raise QftError("--label-column", args.label_column, f"{sum(g in unknown for g in gold)} of {len(gold)} "
                               f"gold labels are not among the run's labels ({', '.join(known)}): "
                               f"{', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}")
        preds, scores, words = predict(run_dir, texts)
        out = Path(args.out or Path(args.texts).with_suffix(".predictions.csv"))
        with open(out, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "prediction", *(["gold"] if gold else []), *[f"loglik_{x}" for x in words]])
            for i, text in enumerate(texts):
                w.writerow([text, preds[i], *([gold[i]] if gold else []), *[f"{v:.6f}" for v in scores[i].tolist()]])
    except QftError as e:
        return fail("qft.tools.predict", e)
    line = f"qft.tools.predict: {len(texts)} texts scored with {run_dir}'s " \
           f"{'adapter' if rec.get('adapter_dir') else 'base model (the run trained no adapter)'} -> {out}"
    if gold:
        line += f"; accuracy {sum(p == g for p, g in zip(preds, gold)) / len(gold):.4f}"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
