"""The result records a budget method draws on (budget.records, budget.bits_records), read through
qft.frame.collect, the one reader of records, and narrowed to one dataset, since accuracies of tasks never pool."""

from __future__ import annotations

from pathlib import Path

from qft import frame
from qft.errors import QftError


def one_dataset(ok, data: str | None, what: str, strict: bool):
    """The records of one dataset (data.source) and its name: `data` where the records hold several, else the
    only one they hold. strict: `data`, when given, must be among them (the records were made for it); not strict:
    it only chooses among several (budget.records_data names the rank records' dataset, which the bits records
    need not share)."""
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
    """The records under a folder named by a budget key, through qft.frame.collect (the one reader of records)."""
    path = Path(str(folder)).expanduser()
    if not path.is_dir():
        raise QftError(key, str(folder), "no such folder")
    return frame.collect([path])
