"""The result records a budget method draws on (budget.records, budget.bits_records), read through
qft.frame.collect, the one reader of records, and narrowed to one dataset, since accuracies of tasks never pool."""

from __future__ import annotations

from pathlib import Path

from qft import frame
from qft.errors import QftError


def one_dataset(ok, data: str | None, what: str, strict: bool):
    """The records of one dataset (data.source) among `ok`, and its name: `data` where they hold several, else the
    only one. `what` names the records in errors. With `strict`, a `data` given must be among them (the records were
    made for it); without, it only chooses among several. Raises QftError on budget.records_data where a choice is
    needed and `data` is None, or `data` is not among them."""
    col = "cfg.data.source"
    sources = sorted(ok[col].dropna().unique()) if col in ok else []
    if len(sources) > 1 or (strict and data is not None):
        if data is None:
            raise QftError("budget.records_data", None, f"the {what} hold several datasets ({', '.join(sources)}); "
                           "choose one, e.g. budget.records_data=" + sources[0])
        if data not in sources:
            raise QftError("budget.records_data", data, f"no ok record of that dataset; the {what} hold: "
                           + (", ".join(sources) or "none"))
        return ok[ok[col] == data], data
    return ok, sources[0] if sources else None


def read_records(key: str, folder):
    """The records under `folder`, read by qft.frame.collect (the one reader of records); raises QftError naming
    `key` (the budget key that set `folder`) where `folder` is no folder."""
    path = Path(str(folder)).expanduser()
    if not path.is_dir():
        raise QftError(key, str(folder), "no such folder")
    return frame.collect([path])
