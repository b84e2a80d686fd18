"""What travels to an offline GPU node (scripts/gpu_payload.py): its size against the limit, the cut wheel, the pins."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_payload", ROOT / "scripts" / "gpu_payload.py")
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


def test_the_tree_leaves_room_for_the_wheels_under_the_limit():
    """Tracked and untracked files travel with the working tree; with .whl/'s allowance they fit the limit."""
    sizes = gp.payload(ROOT / "no-such-folder")
    assert sizes["whl"] == 0 and sizes["tracked"] > 10 * 2**20  # the records, at least
    assert sizes["tracked"] + sizes["untracked"] + gp.ALLOWANCE <= gp.LIMIT, sizes


def test_the_fetched_payload_fits():
    """After scripts/fetch_gpu_wheels.sh: .whl/ within its allowance, everything that travels within the limit."""
    if not gp.filled():
        pytest.skip(".whl/ is not filled: run bash scripts/fetch_gpu_wheels.sh")
    sizes = gp.payload()
    assert sizes["whl"] <= gp.ALLOWANCE and sum(sizes.values()) <= gp.LIMIT, sizes
    assert gp.main(["size"]) == 0
    with zipfile.ZipFile(next(gp.WHL.glob("bitsandbytes-*.whl"))) as z:
        libs = sorted(n.rsplit("/", 1)[1] for n in z.namelist() if n.endswith(".so"))
    assert libs == ["libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{gp.CUDA}.so"]


def test_size_fails_above_the_limit(monkeypatch, capsys):
    monkeypatch.setattr(gp, "payload", lambda whl=None: {"tracked": gp.LIMIT - 5, "untracked": 0, "whl": 6})
    assert gp.main(["size"]) == 1
    assert "total 60.0 MiB of 60 MiB" in capsys.readouterr().out


def _record_line(name: str, data: bytes) -> str:
    return f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"


def test_a_cut_wheel_keeps_the_chosen_library_and_a_record_of_exactly_its_files(tmp_path):
    files = {f"bitsandbytes/libbitsandbytes_{v}.so": v.encode() * 100 for v in ("cpu", "cuda128", "cuda130", "rocm72")}
    files["bitsandbytes/__init__.py"] = b"x = 1\n"
    src = tmp_path / "bitsandbytes-0.50.2-py3-none-any.whl"
    record = "bitsandbytes-0.50.2.dist-info/RECORD"
    with zipfile.ZipFile(src, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(record, "".join(_record_line(n, d) + "\n" for n, d in files.items()) + f"{record},,\n")
    (tmp_path / "out").mkdir()
    out = gp.cut_wheel(src, tmp_path / "out", gp.keep_cuda("130"))
    kept = [n for n in files if not n.endswith(("cuda128.so", "rocm72.so"))]  # in the wheel's order
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == sorted(kept + [record])
        assert z.read(record).decode().splitlines() == [_record_line(n, files[n]) for n in kept] + [f"{record},,"]
        assert z.read("bitsandbytes/libbitsandbytes_cuda130.so") == files["bitsandbytes/libbitsandbytes_cuda130.so"]


def test_the_pins_are_the_versions_the_suite_runs_with():
    """The node gets what this environment passes the tests with, not an older guess."""
    for name, version in {**gp.PINS, **gp.BUILT}.items():
        assert importlib.metadata.version(name) == version, name
