"""Files written whole or not at all: sweep jobs share the caches, and a run killed mid-write must leave the last
good record or checkpoint in place, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)  # read once, at import (setting it is the only way to read it), and put back at once
os.umask(_UMASK)


def write(path: str | Path, fill) -> Path:
    """Write `path` whole or not at all: `fill(tmp)` writes a temp file beside it (same suffix, unique name), which
    replaces `path` once `fill` returns and is removed if it raises; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        fill(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide a shared cache from the other users of a cluster
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
