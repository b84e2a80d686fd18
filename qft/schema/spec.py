"""How one config key is declared: its default, its check, one line of help, and what the config hash and an older
record make of it. The declarations themselves are qft.schema's.

A key is a dataclass field made by `key(...)`; its OmegaConf type is `Any`, so Hydra keeps a value as written and
the check below, not OmegaConf's coercion, refuses `no` for a boolean or 2.5 for an integer with one line naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qft.errors import QftError, boolean, integer, integers, mapping, number, one_of, text

NONE = object()  # no `before`: every record that ever held the group holds the key


@dataclass(frozen=True)
class Int:
    low: int | None = None
    high: int | None = None
    null: bool = False
    what: str | None = None

    def __call__(self, key, value):
        integer(key, value, self.low, self.high, self.what, self.null)


@dataclass(frozen=True)
class Num:
    above: float | None = None
    at_least: float | None = None
    below: float | None = None
    null: bool = False
    what: str | None = None

    def __call__(self, key, value):
        number(key, value, above=self.above, at_least=self.at_least, below=self.below, what=self.what, null=self.null)


@dataclass(frozen=True)
class Bool:
    null: bool = False  # also null (an accel switch: as accel.mode says)

    def __call__(self, key, value):
        if self.null and value is None:
            return
        if self.null and not isinstance(value, bool):
            raise QftError(key, value, "true, false or null")
        boolean(key, value)


@dataclass(frozen=True)
class Choice:
    values: tuple
    null: bool = False

    def __call__(self, key, value):
        if not (self.null and value is None):
            one_of(key, value, (*self.values, *(("null",) if self.null and value is not None else ())))


@dataclass(frozen=True)
class Text:
    what: str = "a non-empty string"
    null: bool = False

    def __call__(self, key, value):
        text(key, value, self.what, self.null)


@dataclass(frozen=True)
class Map:
    what: str
    null: bool = False

    def __call__(self, key, value):
        mapping(key, value, self.what, self.null)


@dataclass(frozen=True)
class BoolOr:
    """true, false or one of `words` (1 is refused although 1 == True)."""
    words: tuple
    what: str

    def __call__(self, key, value):
        if not (isinstance(value, bool) or (isinstance(value, str) and value in self.words)):
            raise QftError(key, value, self.what)


@dataclass(frozen=True)
class IntOr:
    """An integer, or one of `words`."""
    words: tuple
    what: str

    def __call__(self, key, value):
        if not (isinstance(value, str) and value in self.words):
            integer(key, value, what=self.what)


@dataclass(frozen=True)
class WordsOrInts:
    """One of `words`, or a list of integers >= 0."""
    words: tuple
    items: str

    def __call__(self, key, value):
        if isinstance(value, str):
            one_of(key, value, self.words)
        else:
            integers(key, value, 0, f"{', '.join(self.words)}, or a list of {self.items}")


def key(default: Any, help: str, check=None, *, hashed: bool = True, cpu_only: bool = False, before: Any = NONE,
        old_hash: str | None = None, cpu: Any = NONE, off: Any = NONE, of=None):
    """A dataclass field declaring one config key: its `default` and one line of `help`; `check` refuses a bad value
    (None: its module checks it); `hashed`: whether it enters the config hash; `cpu_only`: read by CPU runs only;
    `before`: what an older record lacking it meant; `old_hash`: "with" (hashed at `before` when absent) or
    "without" (left out of the hash at `before`); `cpu`/`off`: an accel switch's value under accel=cpu and
    accel=off; `of`: the class whose keys a map holds (a layer type's settings)."""
    meta = {"help": help, "check": check, "hashed": hashed, "cpu_only": cpu_only, "before": before,
            "old_hash": old_hash, "cpu": cpu, "off": off, "of": of}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _copy(x):
    return {k: _copy(v) for k, v in x.items()} if isinstance(x, dict) else [_copy(v) for v in x] \
        if isinstance(x, list) else x


@dataclass(frozen=True)
class Key:
    """One declared key as the derivations read it."""
    path: str  # dotted, from the config's top
    default: Any
    help: str
    check: Any
    hashed: bool
    cpu_only: bool
    before: Any
    old_hash: str | None
    cpu: Any
    off: Any
    allowed: tuple | None  # the values a Choice allows
    of: Any  # the class whose keys a map holds, or None


def keys_of(cls, prefix: str) -> list[Key]:
    """The Key of each field of the schema class `cls`, its path prefixed by `prefix` ("train."), in declaration
    order."""
    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "???"
        out.append(Key(f"{prefix}{f.name}", default, m.get("help", ""), m.get("check"), m.get("hashed", True),
                       m.get("cpu_only", False), m.get("before", NONE), m.get("old_hash"), m.get("cpu", NONE),
                       m.get("off", NONE), m["check"].values if isinstance(m.get("check"), Choice) else None,
                       m.get("of")))
    return out


def undocumented(cls) -> list[str]:
    """The fields of `cls` without one line of help (a field not made by key() has none)."""
    return [f.name for f in dataclasses.fields(cls)
            if not str(f.metadata.get("help") or "").strip() or "\n" in str(f.metadata.get("help"))]
