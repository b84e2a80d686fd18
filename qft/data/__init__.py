"""Labelled text framed as instructions, split with a fixed seed, tokenized once and cached by content.

A classification example is (text, label): the instruction and the allowed answers go in the system turn,
the text in the user turn, and the label word is the assistant's answer, on which alone the loss falls.
An instruction example (Alpaca-style) has its output as the answer and is scored by exact match.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qft import atomic, schema
from qft.data.sources import SOURCES, read_table  # noqa: F401  (read_table: for qft.tools)
from qft.errors import QftError, integer, one_of

SPLITS = ("train", "val", "test")
PLACEHOLDER = "\uE000TEXT\uE000"


# The version of what `prepare` makes from the raw data; it enters the tokenized-data cache key and every record's
# config hash, so records made by an older version are recomputed, never reused.
#   1: the text budget subtracted each example's own answer, so the prompt length told the gold label; repeats were
#      dropped by raw text; instruction data was split in the sorted order of its outputs.
#   2: one text budget for every example (the longest answer's); repeats dropped by the prompt the model sees;
#      instruction data split at random by data.split_seed, its instruction kept whole; stratification named.
FORMAT = 2


def check(cfg, files: bool = True) -> None:
    """Check the data section `cfg` before anything heavy runs; with `files`, also that a local data.path exists.
    Raises QftError naming the key (data.source, data.path, data.task, data.*_size, data.instruction)."""
    one_of("data.source", cfg.source, SOURCES)
    schema.check(cfg, "data")
    if cfg.source == "local" and not cfg.path:
        raise QftError("data.path", cfg.path, "an existing .csv, .tsv, .json or .jsonl file")
    if files and cfg.source == "local" and not (cfg.path and Path(os.path.expanduser(str(cfg.path))).is_file()):
        raise QftError("data.path", cfg.path, "an existing .csv, .tsv, .json or .jsonl file")
    if cfg.task == "instruction" and cfg.source != "local":
        raise QftError("data.task", cfg.task, "instruction data comes from a local file (data.source=local)")
    for key in ("train_size", "val_size", "test_size"):  # unset on an own file: derived from its rows (sizes)
        integer(f"data.{key}", cfg[key], 1, null=cfg.source == "local")
    try:
        fields = [f[1:] for f in string.Formatter().parse(cfg.instruction or "") if f[1] is not None]
    except ValueError:  # an unmatched brace
        fields = None
    if fields is None or any(f != ("labels", "", None) for f in fields):
        raise QftError("data.instruction", cfg.instruction, "{labels} is its one placeholder, bare (write {{ and }} "
                                                            "for braces)")


# --------------------------------------------------------------------------- splits

def _unique(items):
    """First occurrence of each item[0] (the text, or the prompt the model sees)."""
    seen, out = set(), []
    for it in items:
        if it[0] not in seen:
            seen.add(it[0])
            out.append(it)
    return out


def sizes(cfg, rows: int) -> dict[str, int]:
    """{train, val, test} sizes for a source of `rows` rows under the data section `cfg`: as set, and where a local
    file's data.*_size is null, a fifth to test, a tenth to validation (one at least), the rest to training."""
    test = cfg.test_size if cfg.test_size is not None else max(1, round(rows * 0.2))
    val = cfg.val_size if cfg.val_size is not None else max(1, round(rows * 0.1))
    return {"train": cfg.train_size if cfg.train_size is not None else max(0, rows - test - val), "val": val,
            "test": test}


def split(raw: dict, cfg, stratified: bool = True) -> dict[str, list[tuple]]:
    """{train, val, test} lists drawn from `raw` ({part: [(key, label, ...)]}, "test" an official test split) by the
    data section `cfg` (sizes, split_seed, stratify, test_stream). Repeats of item[0] are dropped and none sits in two
    splits; with `stratified` the draw is label-stratified (balanced: round-robin, proportional: each label's share),
    else seeded at random (instruction data). `prepare` passes the tokenized prompt as item[0]: what is unique is what
    the model sees.
    """
    rng = random.Random(cfg.split_seed)
    test_pool = _unique(raw["test"]) if raw.get("test") else None
    held_out = {it[0] for it in test_pool or []}
    pool = [it for it in _unique(raw.get("all") or raw["train"]) if it[0] not in held_out]
    how = cfg.stratify if stratified else "random"
    own = cfg.test_stream == "own"
    if own and test_pool is None:
        raise QftError("data.test_stream", "own", f"needs an official test split, which {cfg.source} lacks: use shared")

    def by_label(items, rng):
        groups: dict = {}
        for it in items:
            groups.setdefault(it[1], []).append(it)
        for v in groups.values():
            rng.shuffle(v)
        return [groups[k] for k in sorted(groups)]

    def draw(items, n, rng=rng):
        if how == "random":
            items = list(items)
            rng.shuffle(items)
            return items[:n], items[n:]
        queues = by_label(items, rng)
        if how == "proportional":
            n = min(n, len(items))
            quota = [n * len(q) / len(items) for q in queues]
            take = [int(x) for x in quota]
            for i in sorted(range(len(queues)), key=lambda i: take[i] - quota[i])[: n - sum(take)]:
                take[i] += 1
            chosen = [it for q, k in zip(queues, take) for it in q[:k]]
            rest = [it for q, k in zip(queues, take) for it in q[k:]]
            rng.shuffle(chosen)
            return chosen, rest
        order = []
        while len(order) < len(items):
            for q in queues:
                if q:
                    order.append(q.pop())
        return order[:n], order[n:]

    n = sizes(cfg, len(pool))
    if test_pool is None:
        test, pool = draw(pool, n["test"])
    else:  # `own`: its own stream, so the test size moves neither the training nor the validation split
        test, _ = draw(test_pool, n["test"], random.Random(f"test-{cfg.split_seed}") if own else rng)
    val, pool = draw(pool, n["val"])
    train, _ = draw(pool, n["train"])
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


def _encode_many(tokenizer, texts: list[str], keep: int) -> list[list[int]]:
    """The first `keep` tokens of each text. A text is cut to 64 characters a token (plus a margin) first: no
    token is that long, so its first `keep` tokens are those of the whole text, and long articles cost no time."""
    chars = 64 * keep + 1000
    if not texts:
        return []
    return [ids[:keep] for ids in tokenizer([t[:chars] for t in texts], add_special_tokens=False)["input_ids"]]


def _label_words(cfg, raw: dict, tokenizer) -> tuple[list[str], list[str], list[list[int]]]:
    """Dataset labels (sorted), their answer words and tokens; each label needs an answer of its own."""
    labels = sorted({lab for part in raw.values() for _, lab in part})
    if len(labels) < 2:
        raise QftError("data.label_column", cfg.label_column, f"needs at least two labels, found {labels}")
    words = dict(cfg.label_words or {})
    unknown = set(map(str, words)) - set(labels)
    if unknown:
        raise QftError("data.label_words", sorted(unknown), f"not labels of this dataset; labels: {', '.join(labels)}")
    words = {str(k): str(v) for k, v in words.items()}
    label_words = [words.get(lab, lab) for lab in labels]
    label_tokens = [_encode(tokenizer, w) for w in label_words]
    for i, t in enumerate(label_tokens):
        if not t:
            raise QftError("data.label_words", label_words[i], "every label word must tokenize to at least one token")
        for j in range(i):
            short, long_ = sorted((label_tokens[j], t), key=len)
            if long_[:len(short)] == short:  # a label scores as the sum of its tokens' log-probabilities, so a longer
                # label whose tokens begin with a shorter one's never scores above it: it could never be predicted
                raise QftError("data.label_words", f"{labels[j]}:{label_words[j]},{labels[i]}:{label_words[i]}",
                               "every label needs an answer of its own tokens, none the start of another's "
                               "(these two score as one, or the longer never wins); map them to other words")
    return labels, label_words, label_tokens


def _frame(cfg, raw: dict, tokenizer, prefix: list[int], suffix: list[int], labels, label_tokens) -> dict:
    """Every raw example as (prompt ids, label index, answer ids, reference text), the prompt as the model sees it.

    The text budget is the same for every example, `max_length` minus the frame minus the longest answer, so
    nothing but the text can tell the label (a budget by the gold answer's length made the prompt length a label).
    Instruction data keeps its instruction whole and cuts only its input; an example whose answer (with EOS) is over
    max_length // 2 tokens, or whose instruction alone overfills the budget, is left out and counted.
    """
    frame = len(prefix) + len(suffix)
    out, refused = {}, {"answer": 0, "instruction": 0}
    if cfg.task == "classification":
        longest = max(map(len, label_tokens))
        room = cfg.max_length - frame - longest  # prepare checked it before any example was tokenized
        index = {lab: i for i, lab in enumerate(labels)}
        for part, items in raw.items():
            ids = _encode_many(tokenizer, [t for t, _ in items], room)
            out[part] = [(tuple(prefix + x + suffix), index[lab], tuple(label_tokens[index[lab]]), "")
                         for x, (_, lab) in zip(ids, items)]
        return out
    cap = cfg.max_length // 2
    answers = {part: [a + [tokenizer.eos_token_id] for a in _encode_many(tokenizer, [o for _, o in items], cap + 1)]
               for part, items in raw.items()}
    kept = [len(a) for part in answers.values() for a in part if len(a) <= cap]
    longest = max(kept, default=cap)
    room = cfg.max_length - frame - longest
    _check_room(cfg, frame, longest, room)
    for part, items in raw.items():
        instr = _encode_many(tokenizer, [i for (i, _), _ in items], room + 1)
        inputs = _encode_many(tokenizer, [f"\n\n{x}" if x else "" for (_, x), _ in items], room)
        rows = []
        for (_, output), ins, inp, ans in zip(items, instr, inputs, answers[part]):
            if len(ans) > cap:
                refused["answer"] += 1
            elif len(ins) > room:
                refused["instruction"] += 1
            else:
                rows.append((tuple(prefix + ins + inp[:room - len(ins)] + suffix), -1, tuple(ans), output))
        out[part] = rows
    if any(refused.values()):
        print(f"qft: note: left out {refused['answer']} instruction examples whose answer is over data.max_length // 2 = "
              f"{cap} tokens and {refused['instruction']} whose instruction alone is over the {room}-token text budget",
              file=sys.stderr)
    return out


def _check_room(cfg, frame: int, longest: int, room: int) -> None:
    if room < cfg.min_text_tokens:
        raise QftError("data.max_length", cfg.max_length,
                       f"the prompt frame takes {frame} tokens and the longest answer {longest}; needs at least "
                       f"{frame + longest + cfg.min_text_tokens} to leave data.min_text_tokens={cfg.min_text_tokens} "
                       f"for the text")


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts a text with BOS: its `add_bos_token`, or its own encoding (Gemma's, converted from
    a GGUF, adds it in its post-processor with the flag unset, and Gemma reads badly without it)."""
    bos = tokenizer.bos_token_id
    return bos is not None and (bool(getattr(tokenizer, "add_bos_token", False)) or tokenizer("a")["input_ids"][:1] == [bos])


def _frame_ends(cfg, tokenizer, label_words: list[str]) -> tuple[str, str, list[int], list[int]]:
    """The prompt's text and token ids before and after the example text."""
    instruction = cfg.instruction.format(labels=", ".join(label_words)) if cfg.instruction else None
    before, after = _template(tokenizer, instruction)
    prefix, suffix = _encode(tokenizer, before), _encode(tokenizer, after)
    if not tokenizer.chat_template and _adds_bos(tokenizer):
        prefix = [tokenizer.bos_token_id] + prefix
    return before, after, prefix, suffix


def frame_texts(cfg, tokenizer, texts: list[str], label_words: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids of each of `texts`, token ids of each of `label_words`), framed by `tokenizer` exactly as a
    classification run with data section `cfg` framed its examples, so qft.tools.predict scores them alike."""
    _, _, prefix, suffix = _frame_ends(cfg, tokenizer, label_words)
    label_tokens = [_encode(tokenizer, w) for w in label_words]
    room = cfg.max_length - len(prefix) - len(suffix) - max(map(len, label_tokens))
    return [prefix + x + suffix for x in _encode_many(tokenizer, list(texts), room)], label_tokens


def drawn(cfg, seed: int | None):
    """`cfg` with data.split_seed `seed` replaced by the run's seed. Why: where few training examples define a regime,
    their draw is part of what a verdict over seeds must cover, while the cells of a study still share one config
    (the hash keeps `seed`, so the report matches a cell's seeds as one cell)."""
    if cfg.split_seed != "seed":
        return cfg
    if seed is None:
        raise QftError("data.split_seed", "seed", "an integer where no run seed is given")
    out = cfg.copy()
    out.split_seed = seed
    return out


def prepare(cfg, tokenizer, cache_dir: str | Path, seed: int | None = None) -> Task:
    """The Task (label words and tokens, the three Splits, the content key) of the data section `cfg`, framed and
    tokenized by `tokenizer`; read from `cache_dir`'s data/ when the same content was seen before. `seed`: the run's
    seed, which draws the splits under data.split_seed=seed. Raises QftError on data that cannot be framed or split."""
    cfg = drawn(cfg, seed)
    raw, digest = _read(cfg)
    classification = cfg.task == "classification"
    labels, label_words, label_tokens = _label_words(cfg, raw, tokenizer) if classification else ([], [], [])
    before, after, prefix, suffix = _frame_ends(cfg, tokenizer, label_words)
    if classification:  # fail on a too-short max_length before any example is tokenized
        _check_room(cfg, len(prefix) + len(suffix), max(map(len, label_tokens)),
                    cfg.max_length - len(prefix) - len(suffix) - max(map(len, label_tokens)))
    # the tokenizer's fingerprint reads its backend's padding and truncation too, which the plain calls above have
    # just set off: a caller's padded call before prepare (the backend is shared, qft.model.load_tokenizer) does not
    # move the key
    key_src = json.dumps({"raw": digest,
                          "tok": _tokenizer_fingerprint(tokenizer), "before": before, "after": after,
                          "words": label_words, "max_length": cfg.max_length, "task": cfg.task,
                          "split": [cfg.split_seed, cfg.train_size, cfg.val_size, cfg.test_size,
                                    cfg.stratify]
                          + ([cfg.test_stream] if cfg.test_stream != "shared" else []), "v": FORMAT})
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    path = Path(os.path.expanduser(str(cache_dir))) / "data" / f"{cfg.source}-{key}.npz"
    cached = _load_cache(path)
    if cached is None:
        framed = _frame(cfg, raw, tokenizer, prefix, suffix, labels, label_tokens)
        parts = split(framed, cfg, stratified=classification)
        for name in SPLITS:
            if not parts[name]:
                rows = sum(len(v) for v in raw.values())
                raise QftError(f"data.{name}_size", cfg[f"{name}_size"], f"the {name} split is empty: "
                               f"{Path(str(cfg.path)).name if cfg.source == 'local' else cfg.source} has {rows} rows for "
                               f"train, val and test sizes {list(sizes(cfg, rows).values())}; ask for fewer")
        cached = {name: Split([list(p) for p, *_ in items], [list(a) for _, _, a, _ in items],
                              [lab for _, lab, _, _ in items], [] if classification else [r for *_, r in items])
                  for name, items in parts.items()}
        _save_cache(path, cached)
    if any(cfg[f"{name}_size"] is None for name in SPLITS):
        print(f"qft: data: {Path(str(cfg.path)).name} has {sum(len(v) for v in raw.values())} rows; split sizes derived "
              f"from them: " + ", ".join(f"{name} {len(cached[name].prompts)}" for name in SPLITS), file=sys.stderr)
    _note_short(cfg, cached, len(label_words) if classification else 0)
    return Task(cfg.task, label_words, label_tokens, cached, key)


def _note_short(cfg, splits: dict[str, Split], n_labels: int) -> None:
    """A split smaller than asked (repeats dropped, a small pool), or training or validation without every label, is
    said on stderr at every run: a study's design may rest on sizes the data cannot give (the record keeps them)."""
    for name in SPLITS:
        got, asked = splits[name].labels, cfg[f"{name}_size"]
        missing = n_labels - len(set(got)) if name != "test" and n_labels else 0
        if (asked is not None and len(got) < asked) or missing > 0:
            print(f"qft: note: data.{name}_size={asked}: the {name} split holds {len(got)} examples"
                  + (f", {n_labels - missing} of the {n_labels} labels" if missing > 0 else ""), file=sys.stderr)


_READ: dict = {}  # a packaged source's name -> its examples and their digest: this process's last read, one source


def _read(cfg) -> tuple[dict, str]:
    """({part: tuple of examples}, their digest) of the data section `cfg`'s source. A packaged source is held once
    read until another is (a sweep's later runs skip re-reading it); a local file, of no bounded size, is read each call."""
    if cfg.source in _READ:
        raw, digest = _READ[cfg.source]
        return dict(raw), digest
    raw = {part: tuple(items) for part, items in SOURCES[cfg.source](cfg).items()}
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
    if cfg.source != "local":
        _READ.clear()
        _READ[cfg.source] = raw, digest
    return dict(raw), digest


def _flat(seqs):
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if seqs else np.zeros(0, np.int64), \
        np.cumsum([0] + [len(s) for s in seqs], dtype=np.int64)


def _save_cache(path: Path, splits: dict[str, Split]) -> None:
    arrays = {}
    for name, s in splits.items():
        arrays[f"{name}.prompts"], arrays[f"{name}.prompt_offsets"] = _flat(s.prompts)
        arrays[f"{name}.answers"], arrays[f"{name}.answer_offsets"] = _flat(s.answers)
        arrays[f"{name}.labels"] = np.asarray(s.labels, dtype=np.int64)
        arrays[f"{name}.texts"] = np.asarray(s.texts, dtype=np.str_)
    atomic.write(path, lambda tmp: np.savez(tmp, **arrays))  # concurrent sweep jobs never read a half-written cache


def _load_cache(path: Path) -> dict[str, Split] | None:
    if not path.exists():
        return None
    try:
        z = np.load(path, allow_pickle=False)
    except Exception:
        return None  # a damaged cache is rebuilt
    if not all(f"{name}.texts" in z.files for name in SPLITS):
        return None

    def unflat(flat, off):
        return [flat[a:b].tolist() for a, b in zip(off[:-1], off[1:])]
    return {name: Split(unflat(z[f"{name}.prompts"], z[f"{name}.prompt_offsets"]),
                        unflat(z[f"{name}.answers"], z[f"{name}.answer_offsets"]),
                        z[f"{name}.labels"].tolist(), z[f"{name}.texts"].tolist()) for name in SPLITS}


def batch(seqs: list[list[int]], pad_id: int):
    """(ids, mask, positions) tensors of `seqs` left-padded with `pad_id`: every sequence ends at the last column, so
    the answers and their next-token logits sit at the same columns across the batch."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions
