"""Servers and workloads from YAML or plain mappings, with every unknown key named, so a described machine
needs no Python."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qft.errors import QftError
from qft.tools.simulate.inputs import Server, Stage, Workload
from qft.tools.simulate.presets import SERVERS, workload_from_model


def _from_dict(cls, d: dict, key: str, convert=None):
    """Dataclass `cls` from mapping `d` (after `convert`); raises QftError naming `key`.<field> on an unknown key."""
    if not isinstance(d, dict):
        raise QftError(key, d, "a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in names:
            raise QftError(f"{key}.{k}", d[k], f"allowed keys: {', '.join(sorted(names))}")
    d = {k: (float(v) if isinstance(v, str) and k not in ("name", "schedule", "kind") and _is_float(v) else v)
         for k, v in d.items()}  # YAML 1.1 reads 24e9 (no dot) as a string
    try:
        return cls(**(convert(d) if convert else d))
    except TypeError as e:
        raise QftError(key, d, str(e)) from None


def server_from_dict(d: dict) -> Server:
    """The Server of mapping `d`; raises QftError naming the server key."""
    def conv(x):
        x = dict(x)
        if "nvlink_pairs" in x:
            pairs = x["nvlink_pairs"]
            if not isinstance(pairs, (list, tuple)) or any(not isinstance(q, (list, tuple)) for q in pairs):
                raise QftError("server.nvlink_pairs", pairs, "a list of [gpu, gpu] pairs")
            x["nvlink_pairs"] = tuple(tuple(q) for q in pairs)
        return x
    return _from_dict(Server, d, "server", conv)


def _is_float(v: str) -> bool:
    """Whether string `v` reads as a float."""
    try:
        float(v)
        return True
    except ValueError:
        return False


def workload_from_dict(d: dict, stages: int | None = None) -> Workload:
    """The Workload of mapping `d`: {model: llama2-7b, micro_batches: 16, ...} (derived, over `stages` stages) or
    {stages: [{fwd_s: ...}, ...], ...}; raises QftError naming the workload key."""
    if not isinstance(d, dict):
        raise QftError("workload", d, "a mapping")
    if "model" in d:
        kw = dict(d)
        kw.setdefault("stages", stages)
        allowed = set(workload_from_model.__code__.co_varnames[:workload_from_model.__code__.co_argcount])
        for k in kw:
            if k not in allowed:
                raise QftError(f"workload.{k}", kw[k], f"allowed keys: {', '.join(sorted(allowed))}")
        return workload_from_model(**kw)
    st = d.get("stages")
    if not isinstance(st, list) or not st:
        raise QftError("workload.stages", st, "a list of {fwd_s, bwd_s, act_bytes, fixed_bytes[, boundary_bytes]}")
    stage_objs = tuple(_from_dict(Stage, x, f"workload.stages[{i}]") for i, x in enumerate(st))
    rest = {k: v for k, v in d.items() if k != "stages"}
    return _from_dict(Workload, {**rest, "stages": stage_objs}, "workload")


def load(path: str | Path) -> tuple:
    """(Server, Workload or None) of YAML file `path`: server keys at the top level, or server: and workload:."""
    import yaml

    try:
        d = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise QftError("server", str(path), f"a preset ({', '.join(SERVERS)}) or an existing YAML file") from None
    except yaml.YAMLError as e:
        raise QftError("server", str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise QftError("server", str(path), "a YAML mapping")
    if "server" in d:
        extra = set(d) - {"server", "workload"}
        if extra:
            k = sorted(extra)[0]
            raise QftError(k, d[k], "allowed top-level keys: server, workload")
        return server_from_dict(d["server"]), (d.get("workload"))
    return server_from_dict(d), None
