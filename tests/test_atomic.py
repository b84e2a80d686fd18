"""Records, checkpoints and the shared caches are written whole or not at all (qft.atomic): a failed write leaves the
previous file, and no temp file behind, and every writer goes through the one helper."""

import ast
from pathlib import Path

import numpy as np
import pytest

from qft import atomic

QFT = Path(__file__).resolve().parent.parent / "qft"


def test_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "deeper" / "record.json"
    assert atomic.write(path, lambda tmp: Path(tmp).write_text("first")) == path
    atomic.write(path, lambda tmp: Path(tmp).write_text("second"))
    assert path.read_text() == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["record.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("good")

    def half(tmp):
        Path(tmp).write_text("half of a rec")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write(path, half)
    assert path.read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_the_temp_file_sits_beside_the_target(tmp_path):
    """Same folder, so the rename never crosses file systems; a hidden name a glob for results skips."""
    seen = []
    atomic.write(tmp_path / "a.npz", lambda tmp: seen.append(Path(tmp)) or Path(tmp).write_bytes(b"x"))
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".a.npz.") and seen[0].suffix == ".npz"


def test_numpy_writes_to_the_temp_file_itself(tmp_path):
    """numpy's savez adds ".npz" to a name without it; the temp name keeps the suffix, so nothing is left beside."""
    atomic.write(tmp_path / "scores.npz", lambda tmp: np.savez(tmp, x=np.arange(3)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.npz"]
    assert np.load(tmp_path / "scores.npz")["x"].tolist() == [0, 1, 2]


def test_no_module_writes_through_its_own_temp_file_and_rename():
    """One helper, not six copies: no qft module but qft.atomic calls tempfile.mkstemp and os.replace on a file.
    (Folders renamed into place, by qft.model and qft.evaluate, use mkdtemp and are another thing.)"""
    offenders = []
    for p in QFT.rglob("*.py"):
        if p.name == "atomic.py" and p.parent == QFT:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    (node.value.id, node.attr) == ("tempfile", "mkstemp"):
                offenders.append(str(p.relative_to(QFT)))
    assert offenders == []


def test_the_file_gets_the_mode_a_plain_open_would_give(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    atomic.write(tmp_path / "atomic", lambda tmp: Path(tmp).write_text("x"))
    assert (tmp_path / "atomic").stat().st_mode == plain.stat().st_mode
