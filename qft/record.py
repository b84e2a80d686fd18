"""The result record: one JSON file per run, written atomically, the single source of truth downstream.

Sweeps resume from it and reports read only it, so it carries the resolved config and its hash, the
status and everything measured.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from qft import atomic, data, model, schema

RECORD = "result.json"
SCHEMA = 2
# What the hash leaves out, what an older record lacking a key is hashed with, what is left out at the value that
# computed what came before, and which settings keep their order: each declared with its key in qft.schema.
_NOT_HASHED = schema.not_hashed()
_THEN = schema.hashed_with()
_ABSENT_AT = schema.hashed_without()
_ORDERED = schema.ORDERED


def resolved(cfg) -> dict:
    """`cfg` as a plain dict, interpolations resolved."""
    return OmegaConf.to_container(cfg, resolve=True)


def inputs(cfg) -> dict:
    """{input: digest} of what a run of `cfg` reads besides its config: the data-format version, a local data file,
    a local model or the packaged GGUF, and the records a fitted budget solves from (digests memoised in the cache)."""
    cache = Path(os.path.expanduser(str(cfg.cache_dir)))
    out = {"data_format": data.FORMAT}
    if cfg.data.source == "local" and cfg.data.path:
        out["data_file"] = model.content_digest(Path(os.path.expanduser(str(cfg.data.path))), cache)
    if cfg.model.path:
        out["model_files"] = model.content_digest(Path(os.path.expanduser(str(cfg.model.path))), cache)
    elif cfg.model.source == "pypi_gguf":
        spec = importlib.util.find_spec(cfg.model.package)
        if spec is not None and spec.origin is not None:
            out["model_files"] = model.packaged_digest(cfg.model.package, cfg.model.file, cache)
    b = cfg.budget
    if b.params is not None and b.method == "fitted" and b.records:
        folder = Path(os.path.expanduser(str(b.records)))
        out["budget_records"] = hashlib.sha256("".join(
            f"{p.relative_to(folder)}:{model.content_digest(p, cache)}\n" for p in sorted(folder.rglob(RECORD))
        ).encode()).hexdigest() if folder.is_dir() else None
    return out


def config_hash(cfg, ignore: tuple = (), inputs_: dict | None = None) -> str:
    """The sha256 of what a run of `cfg` computes: the config less the keys that change only how it runs (depth
    groups in order, 16.0 as 16), plus `inputs_` (default: inputs(cfg); a record passes its own).
    `ignore`: more top-level keys to drop (the report pools seeds so)."""
    live = not isinstance(cfg, dict)
    conf = resolved(cfg) if live else copy.deepcopy(cfg)
    for key in ignore:
        conf.pop(key, None)
    for path, then in _THEN.items():
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict):
            parent.setdefault(path[-1], then)
    for path, default in _ABSENT_AT.items():
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict) and parent.get(path[-1], default) == default:
            parent.pop(path[-1], None)
    if (conf.get("budget") or {}).get("params") is None:
        conf.pop("budget", None)  # a budget that is off is no part of the config
    for path in _NOT_HASHED:
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    for path in _ORDERED:
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict) and isinstance(parent.get(path[-1]), dict):
            parent[path[-1]] = [[k, v] for k, v in parent[path[-1]].items()]
    conf["inputs"] = inputs_ if inputs_ is not None else (inputs(cfg) if live else {})
    return hashlib.sha256(json.dumps(_numbers(conf), sort_keys=True).encode()).hexdigest()


# Config keys that say which kind of machine ran a cell, not which cell it is: the compute dtype (bf16 where the CPU
# has it, fp32 where it does not, under `auto`) and the device. They stay in the config hash (every record keeps its
# stored hash), and a cell is matched across run kinds by `cell_key`, which leaves them and the seed out.
KIND_ONLY = (("quant", "compute_dtype"), ("device",))


def cell_key(config: dict, inputs_: dict | None = None) -> str:
    """The cell of a study a record's `config` (with its `inputs_`) belongs to, whatever kind ran it: the config hash
    less the seed and the KIND_ONLY keys, so a bf16 and an fp32 seed of one configuration share a cell."""
    conf = copy.deepcopy(config)
    conf.pop("seed", None)
    for path in KIND_ONLY:
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return config_hash(conf, inputs_=inputs_ or {})


def _numbers(x):
    """`x` with every integral float made an int (16.0 -> 16), nested; a value typed either way hashes alike."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    return x


def _get(conf: dict, path: tuple):
    """The value at key `path` in nested dict `conf`, or None."""
    for k in path:
        conf = conf.get(k) if isinstance(conf, dict) else None
    return conf


def versions_of(packages) -> dict:
    """{package: installed version, or None} for each of `packages`."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def versions() -> dict:
    """The versions a record keeps: Python and the training stack's packages."""
    return {"python": platform.python_version(),
            **versions_of(("torch", "transformers", "peft", "bitsandbytes", "datasets", "hydra-core"))}


def _cpuinfo() -> dict:
    """The first processor's fields in /proc/cpuinfo (empty where there is no such file)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}


def cpu_kind() -> tuple[str, str]:
    """This machine's CPU model name and the kind that decides its fast compute dtype: amx_bf16, avx512_bf16,
    avx512f or avx2 (the first of these flags it has), else the architecture."""
    info = _cpuinfo()
    cpu = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    return cpu, next((k for k in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if k in flags), platform.machine())


def cpu_id() -> str | None:
    """"family F model M stepping S" from /proc/cpuinfo (x86), or None where it does not say: a hypervisor may give
    every CPU generation one model name, and the numbers tell them apart."""
    info = _cpuinfo()
    if "cpu family" not in info or "model" not in info:
        return None
    return f"family {info['cpu family']} model {info['model']} stepping {info.get('stepping', '?')}"


def _code_identity() -> dict:
    """{commit, edits (whether qft/ or conf/ differ from it), digest of qft/ and conf/ as read at import}: the code
    that runs, even when the checkout moves on during a sweep."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*(root / "qft").rglob("*.py"), *(root / "conf").rglob("*.yaml")])
    digest = hashlib.sha256(b"".join(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes()
                                     for f in files)).hexdigest()[:16]
    commit = dirty = None
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
        if commit:
            dirty = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", "qft", "conf"],
                                        capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {"qft_commit": commit, "qft_edited": dirty, "qft_source": digest}


_CODE = _code_identity()


# execution switches (accel.*): here the config's ask; once a run has built its model, whether each was installed
# (run.build)
SWITCHES = tuple(k for k in schema.cpu_only("accel") if k != "fuse_projections")  # fusion is recorded apart


def execution(cfg) -> dict:
    """What executes a run of `cfg`, outside its hash: qft's code (_code_identity), the CPU and its kind, the thread
    count and the compute dtype. One comparison must not mix CPU kinds or compute dtypes."""
    import torch

    cpu, kind = cpu_kind()
    dev = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    return {**_CODE, "qft_version": versions_of(("qft",))["qft"], "cpu": cpu, "cpu_id": cpu_id(),
            "cpu_kind": kind, "threads": torch.get_num_threads(), "compute_dtype": cfg.quant.compute_dtype,
            "accel": schema.accel_mode(cfg, dev),
            **{k: bool(v) for k, v in schema.accel_switches(cfg, dev).items() if k in ("fuse_projections", *SWITCHES)},
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


EXAMPLES = "examples.npz"


def write_examples(run_dir: Path, examples: dict, label_words: list) -> str | None:
    """Write `examples` ("final.test" -> {index, id, gold, loglik, pred, correct}) and `label_words` into `run_dir`
    atomically as one npz (no pickle); returns its file name for the record."""
    if not examples:
        return None
    arrays = {f"{phase}.{k}": v for phase, cols in examples.items() for k, v in cols.items()}
    arrays["label_words"] = np.asarray(label_words, dtype=np.str_)
    atomic.write(run_dir / EXAMPLES, lambda tmp: np.savez_compressed(tmp, **arrays))
    return EXAMPLES


def read_examples(run_dir: Path, rec: dict | None = None) -> dict | None:
    """{"final.test": {column: array}, ...} of record `rec` in `run_dir`, or None where the record names none or it is gone."""
    rec = rec if rec is not None else read(run_dir)
    name = (rec or {}).get("examples")
    if not name or not (Path(run_dir) / name).is_file():
        return None
    with np.load(Path(run_dir) / name, allow_pickle=False) as z:
        out: dict = {}
        for key in z.files:
            if "." in key:
                phase, split, col = key.split(".", 2)
                out.setdefault(f"{phase}.{split}", {})[col] = z[key]
        return out


def reset_peak_memory(device) -> None:
    """Restart the peak memory count on `device` (Linux: VmHWM, by writing 5 to clear_refs; CUDA: its peak stats).

    A sweep's jobs share one process, whose lifetime peak would carry into every later record; elsewhere it does."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _vm_hwm() -> int | None:
    """This process's resident high-water mark in bytes (/proc/self/status), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory(device) -> dict:
    """{"peak_rss_bytes": peak resident set since reset_peak_memory} plus, on a CUDA `device`, the peak allocated
    bytes."""
    out = {"peak_rss_bytes": _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if getattr(device, "type", device) == "cuda":
        import torch

        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dict `d` flattened to dotted keys (after `prefix`), lists and empty dicts as JSON strings: for tables
    and trackers."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else v
    return out


def write(run_dir: Path, record: dict) -> Path:
    """Write `record` as RECORD in `run_dir`, atomically; returns its path."""
    return atomic.write(run_dir / RECORD, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1)))


def read(run_dir: Path) -> dict | None:
    """The record in `run_dir`, or None where there is none or it is unreadable."""
    path = Path(run_dir) / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
