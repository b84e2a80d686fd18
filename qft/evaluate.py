"""Accuracy by scoring: each candidate label word's log-likelihood at the answer position, best one wins.

One scorer for zero-shot and final accuracy, so the two compare; multi-token labels are scored exactly from the
prompt's KV cache. The `evaluate` group adds MMLU after training, scored in memory through lm-eval-harness (its own
prompt, shots and scoring, so published lm-eval figures compare) from a local copy of the CSVs.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from qft.data import Split, Task, batch
from qft import schema
from qft.errors import QftError, integer
from qft.model import autocast, device_of


@torch.no_grad()
def label_scores(model, prompts: list[list[int]], label_tokens: list[list[int]], pad_id: int,
                 batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (n, n_labels) log-likelihood of each of `label_tokens` after each of `prompts` (token ids, left-padded
    with `pad_id`), scored by `model` in batches of `batch_size` under autocast in `dtype`."""
    was_training = model.training
    model.eval()
    dev = device_of(model)
    out = []
    for start in range(0, len(prompts), batch_size):
        ids, mask, pos = (t.to(dev) for t in batch(prompts[start:start + batch_size], pad_id))
        with autocast(dev, dtype):
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(res.logits[:, -1].float(), -1)
        scores = torch.stack([first[:, t[0]] for t in label_tokens], 1)
        last = pos[:, -1:]
        for c, tokens in enumerate(label_tokens):
            if len(tokens) == 1:
                continue
            # each candidate extends its own copy of the prompt's cache: cropping it back fails on sliding-window
            # layers (Gemma-3) once a prompt reaches the window
            cache = copy.deepcopy(res.cache)
            ext = torch.tensor(tokens[:-1], device=dev).expand(ids.shape[0], -1)
            k = ext.shape[1]
            with autocast(dev, dtype):
                r = model(input_ids=ext, attention_mask=torch.cat([mask, torch.ones_like(ext)], 1),
                          position_ids=last + 1 + torch.arange(k, device=dev), cache=cache, use_cache=True)
            lp = torch.log_softmax(r.logits.float(), -1)
            scores[:, c] += sum(lp[:, j, tokens[j + 1]] for j in range(k))
        out.append(scores)
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def exact_match(model, split: Split, tokenizer, batch_size: int, dtype: torch.dtype) -> list[bool]:
    """For each example of `split`, whether `model`'s greedy generation (decoded by `tokenizer`, batches of
    `batch_size`, autocast in `dtype`) equals its reference answer, whitespace-stripped."""
    was_training = model.training
    model.eval()
    dev = device_of(model)
    hits = []
    max_new = max(map(len, split.answers)) + 4
    for start in range(0, len(split.prompts), batch_size):
        ids, mask, _ = (t.to(dev) for t in batch(split.prompts[start:start + batch_size], tokenizer.pad_token_id))
        with autocast(dev, dtype):
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True)
        for row, ref in zip(gen[:, ids.shape[1]:], split.texts[start:start + batch_size]):
            hits.append(tokenizer.decode(row, skip_special_tokens=True).strip() == ref.strip())
    model.train(was_training)
    return hits


def example_ids(split: Split) -> np.ndarray:
    """A stable id for each example of `split`: 16 hex digits of the sha256 of its prompt's token ids. With the index
    it names the example across runs: two configurations agree on it iff they saw the same prompt."""
    return np.asarray([hashlib.sha256(np.asarray(p, dtype=np.int64).tobytes()).hexdigest()[:16] for p in split.prompts],
                      dtype=np.str_)


def score(model, task: Task, split_name: str, tokenizer, batch_size: int, dtype: torch.dtype) -> dict:
    """{"accuracy", "examples"} of `model` on `task`'s split `split_name` (`tokenizer`, `batch_size`, `dtype` as in
    label_scores): each example's id, gold label, every label's log-likelihood, prediction and correctness
    (instruction data: exact match only, gold -1)."""
    split = task.splits[split_name]
    examples = {"index": np.arange(len(split.prompts), dtype=np.int64), "id": example_ids(split),
                "gold": np.asarray(split.labels, dtype=np.int64)}
    if task.kind == "instruction":
        examples["correct"] = np.asarray(exact_match(model, split, tokenizer, batch_size, dtype), dtype=bool)
    else:
        scores = label_scores(model, split.prompts, task.label_tokens, tokenizer.pad_token_id, batch_size, dtype)
        examples["loglik"] = scores.cpu().numpy().astype(np.float32)
        # an exact tie (bf16 logits that round alike: 0.27-0.36% of findings 1-3's test predictions, worth at most
        # +0.0003 of their accuracy against random tie-breaking) goes to the lower label index; `loglik` keeps them
        examples["pred"] = scores.argmax(1).cpu().numpy().astype(np.int64)
        examples["correct"] = examples["pred"] == examples["gold"]
    return {"accuracy": float(examples["correct"].mean()), "examples": examples}


def accuracy(model, task: Task, split_name: str, tokenizer, batch_size: int, dtype: torch.dtype) -> float:
    """score(`model`, `task`, `split_name`, `tokenizer`, `batch_size`, `dtype`)'s accuracy."""
    return score(model, task, split_name, tokenizer, batch_size, dtype)["accuracy"]


# --------------------------------------------------------------------------- benchmarks (the evaluate group)

MMLU_LAYOUT = "a folder with MMLU's dev/<subject>_dev.csv and test/<subject>_test.csv (set QFT_MMLU_DIR)"
LETTERS = ("A", "B", "C", "D")


def mmlu_subjects(folder: Path) -> list[str]:
    """The subjects under `folder` that have both a dev and a test CSV, sorted."""
    if not (folder / "test").is_dir():
        return []
    tests = {p.name[:-len("_test.csv")] for p in (folder / "test").glob("*_test.csv")}
    return sorted(s for s in tests if (folder / "dev" / f"{s}_dev.csv").is_file())


def read_mmlu_csv(path: Path) -> list[dict]:
    """The rows `question,A,B,C,D,answer` (no header) of CSV `path` as cais/mmlu's schema: question, choices, answer
    index. Read as strings, as the original loader did (pandas would turn "1.50" into 1.5, "None" into missing)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for line, row in enumerate(csv.reader(f), 1):
            if len(row) != 6 or row[5].strip() not in LETTERS:
                raise QftError("evaluate.path", str(path), f"line {line}: want 6 columns question,A,B,C,D,answer "
                                                             f"with the answer one of A, B, C, D")
            rows.append({"question": row[0], "choices": row[1:5], "answer": LETTERS.index(row[5].strip())})
    return rows


def _selected(cfg) -> tuple[Path, list[str]]:
    """(folder, subjects) evaluate group `cfg` selects; raises QftError (evaluate.path, evaluate.subjects)."""
    folder = Path(os.path.expanduser(str(cfg.path)))
    found = mmlu_subjects(folder)
    if not found:
        raise QftError("evaluate.path", str(cfg.path), ("no such folder: want " if not folder.is_dir() else "want ")
                       + MMLU_LAYOUT)
    if cfg.subjects is None:
        return folder, found
    if not isinstance(cfg.subjects, Sequence):  # a string is one subject
        raise QftError("evaluate.subjects", cfg.subjects, "a subject, a list of subjects, or null (all)")
    subjects = list(cfg.subjects) if not isinstance(cfg.subjects, str) else [cfg.subjects]
    missing = [s for s in subjects if s not in found]
    if not subjects or missing:
        raise QftError("evaluate.subjects", subjects, f"subjects of {folder} (null: all): "
                       f"{', '.join(found[:8])}{', ...' if len(found) > 8 else ''}")
    return folder, subjects


def check(cfg) -> None:
    """Check evaluate group `cfg` (None: no benchmark), reading its data so a bad CSV fails before training; raises
    QftError naming the key (evaluate.path, evaluate.subjects, evaluate.benchmark, ...)."""
    if cfg is None:
        return
    schema.check(cfg, "evaluate", only=("benchmark",))
    folder, subjects = _selected(cfg)
    shots = cfg.shots
    fewest = min(len(read_mmlu_csv(folder / "dev" / f"{s}_dev.csv")) for s in subjects)
    for s in subjects:
        read_mmlu_csv(folder / "test" / f"{s}_test.csv")
    integer("evaluate.shots", shots, 0, fewest, f"an integer from 0 to {fewest} (the fewest dev examples of a subject)")
    schema.check(cfg, "evaluate", only=("limit", "batch_size", "before_training"))
    if importlib.util.find_spec("lm_eval") is None:
        raise QftError("evaluate.benchmark", "mmlu", "needs lm-eval-harness: pip install 'qft[paper]' (lm-eval>=0.4)")


def _task_dir(folder: Path, subjects: list[str], cache_dir) -> Path:
    """The folder under `cache_dir` of lm-eval task YAMLs for `subjects`, over `folder`'s CSVs converted to
    cais/mmlu's schema (JSONL) and cached by content, so every sweep job reuses them; lm-eval's template prompts."""
    from lm_eval import tasks as lm_tasks

    template = Path(lm_tasks.__file__).parent / "mmlu" / "default" / "_default_template_yaml"
    digest = hashlib.sha256(template.read_bytes())
    for s in subjects:
        for split in ("dev", "test"):
            digest.update(f"{s}/{split}".encode() + (folder / split / f"{s}_{split}.csv").read_bytes())
    out = Path(os.path.expanduser(str(cache_dir))) / "mmlu" / digest.hexdigest()[:16]
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    for s in subjects:
        files = {}
        for split in ("dev", "test"):
            files[split] = str(out / f"{s}_{split}.jsonl")
            with open(tmp / f"{s}_{split}.jsonl", "w", encoding="utf-8") as f:
                for row in read_mmlu_csv(folder / split / f"{s}_{split}.csv"):
                    f.write(json.dumps({**row, "subject": s}) + "\n")
        task = {"include": str(template), "task": f"qft_mmlu_{s}", "task_alias": s,
                "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": files},
                "description": f"The following are multiple choice questions (with answers) about "
                               f"{s.replace('_', ' ')}.\n\n"}
        (tmp / f"qft_mmlu_{s}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML
    try:
        os.replace(tmp, out)  # atomic: concurrent sweep jobs never see a half-written folder
    except OSError:  # another job got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def mmlu_results(cfg, model, tokenizer, dtype: torch.dtype, cache_dir) -> dict:
    """lm-eval's own output, with per-sample log-likelihoods, for MMLU (evaluate group `cfg`) on in-memory `model`
    and `tokenizer` under autocast in `dtype`; task files cached under `cache_dir`."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    folder, subjects = _selected(cfg)
    manager = TaskManager(include_path=str(_task_dir(folder, subjects, cache_dir)), include_defaults=False)
    was_training = model.training
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size)
    try:
        with autocast(device_of(model), dtype):
            return lm_eval.simple_evaluate(model=lm, tasks=[f"qft_mmlu_{s}" for s in subjects],
                                           num_fewshot=cfg.shots, limit=cfg.limit, task_manager=manager,
                                           log_samples=True)
    finally:
        model.train(was_training)


def summarize_mmlu(results: dict) -> dict:
    """Accuracy over all questions of lm-eval `results` (each counts once, as lm-eval weights MMLU's groups), its
    standard error, and the accuracy per subject."""
    per, correct, n = {}, 0.0, 0
    for task, r in sorted(results["results"].items()):
        k = len(results["samples"][task])
        per[task.removeprefix("qft_mmlu_")] = {"acc": r["acc,none"], "acc_stderr": r["acc_stderr,none"], "n": k}
        correct, n = correct + r["acc,none"] * k, n + k
    acc = correct / n
    shots = {t: c.get("num_fewshot") for t, c in results["configs"].items()}
    return {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None, "n": n,
            "shots": next(iter(set(shots.values()))) if len(set(shots.values())) == 1 else shots,
            "per_subject": per, "lm_eval": results.get("lm_eval_version") or _version("lm_eval")}


def _version(package: str) -> str | None:
    """The installed version of `package`, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return None


def benchmarks(cfg, model, tokenizer, dtype: torch.dtype) -> dict:
    """The record's benchmark keys for a finished run of config `cfg` on `model`, `tokenizer`, `dtype`: {} without a
    benchmark, else {"mmlu": {...}}, with the base model's score (adapters off) where evaluate.before_training."""
    ev = cfg.get("evaluate")
    if ev is None:
        return {}
    out = summarize_mmlu(mmlu_results(ev, model, tokenizer, dtype, cfg.cache_dir))
    if ev.before_training:
        if hasattr(model, "disable_adapter"):  # LoRA starts at B = 0: the base model is the model before training
            with model.disable_adapter():
                out["before_training"] = summarize_mmlu(mmlu_results(ev, model, tokenizer, dtype, cfg.cache_dir))
        else:  # no adapter anywhere: nothing was trained
            out["before_training"] = {k: v for k, v in out.items()}
    return {"mmlu": out}
