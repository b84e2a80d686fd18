"""The result record: one JSON file per run, written atomically, the single source of truth downstream.

Sweeps resume from it and reports read only it, so it carries the resolved config and its hash, the
status and everything measured.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import resource
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from omegaconf import OmegaConf

RECORD = "result.json"
SCHEMA = 1
# keys that change how a run is executed, resumed, logged or swept, not what it computes (the speed and
# memory switches are tested to give the same losses and gradients)
_NOT_HASHED = {("train", "resume"), ("train", "stop_after_steps"), ("train", "host_allocator"), ("cache_dir",), ("sweep",), ("grid",), ("logger",),
               ("quant", "cache_dequantized"), ("quant", "cache_quantized"), ("offload",),
               ("budget", "bits_records")}  # read by python -m qft.budget only, never by a run
# keys added after records existed, left out of the hash at the value that means the old behaviour, so those
# records keep their hash (a sweep still skips them)
_HASHED_UNLESS = {("adapter", "dropout_mask"): "torch"}


def resolved(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def config_hash(cfg, ignore: tuple = ()) -> str:
    """sha256 of what a run computes; `ignore` drops more top-level keys (the report pools seeds so)."""
    conf = copy.deepcopy(cfg) if isinstance(cfg, dict) else resolved(cfg)
    for key in ignore:
        conf.pop(key, None)
    if (conf.get("budget") or {}).get("params") is None:
        conf.pop("budget", None)  # a budget that is off is no part of the config
    for path in _NOT_HASHED | {p for p, old in _HASHED_UNLESS.items() if _get(conf, p) in (old, None)}:
        parent = _get(conf, path[:-1])
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()


def _get(conf: dict, path: tuple):
    for k in path:
        conf = conf.get(k) if isinstance(conf, dict) else None
    return conf


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "datasets", "hydra-core"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def reset_peak_memory(device) -> None:
    """Start this run's peak afresh: a sweep runs its jobs in one process, whose lifetime peak (ru_maxrss) would
    carry an earlier job's peak into every later record. Linux resets the resident high-water mark (VmHWM) on
    writing 5 to clear_refs; elsewhere the lifetime peak stays what is recorded."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory(device) -> dict:
    """Peak resident set of this process since the run began (CPU), or peak allocated tensors (CUDA), in bytes."""
    out = {"peak_rss_bytes": _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if getattr(device, "type", device) == "cuda":
        import torch

        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """Dotted keys for nested config, for tables and trackers; lists stay JSON strings."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else v
    return out


def write(run_dir: Path, record: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
    return path


def read(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
