"""The config schema (qft.schema.groups) and what is derived from it: Hydra's group schemas, the value checks, the
config hash's exclusions and older records' meanings, the sweep directory's excluded keys and the declared keys.

A composed config holds only its presets' keys; `complete` fills every other declared key at its default before a
run or a tool reads it, so the record holds every key (`loaded`: an older record's, at the value it meant).
Nothing here imports a config group's module, so every module can import it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from qft.schema import groups as G
from qft.schema.spec import NONE, Key, keys_of, undocumented  # noqa: F401  (undocumented: for the schema's test)

# Hydra config group -> its schemas, by the name a preset's defaults list extends (conf/train/cpu_small.yaml:
# `defaults: [_schema, _self_]`). A group whose presets differ in shape has one schema per shape.
GROUPS = {
    "model": {"_packaged": G.Packaged, "_local": G.Local, "_random": G.Random},
    "data": {"_schema": G.Data},
    "quant": {"_schema": G.Quant},
    "adapter": {"_schema": G.Adapter},
    "train": {"_schema": G.Train},
    "logger": {"_none": G.Logger, "_tensorboard": G.TensorBoard, "_mlflow": G.MLflow},
    "offload": {"_schema": G.Offload},
    "accel": {"_schema": G.Accel},
    "evaluate": {"_mmlu": G.Evaluate},
    "budget": {"_schema": G.Budget},
}
# the top level's own keys and sections (conf/config.yaml extends them as `_top`)
TOP = {"": G.Top, "sweep": G.Sweep}
# keys only presets add: an experiment's sweep grid (conf/experiment/_sweep.yaml), outside the hash
PRESET_ONLY = {"grid": "the values an experiment sweeps, by axis (conf/experiment/_sweep.yaml): open map"}
# keys older records hold under another name, outside the hash as they were: never read, never set
RETIRED = {"train.host_allocator": "accel.host_allocator", "train.fuse_projections": "accel.fuse_projections",
           "train.compiled_masks": "accel.compiled_masks", "train.compiled_sums": "accel.compiled_sums",
           "train.compiled_rope": "accel.compiled_rope", "train.split_rows": "accel.split_rows",
           "quant.cache_quantized": "accel.cache_quantized", "quant.cache_dequantized": "accel.cache_dequantized"}
# open maps: their keys are the user's (transformers fields, dataset labels, projections and depth groups, an
# experiment's axes); a map's entries are checked by its module
OPEN = ("model.arch", "data.label_words", "adapter.projections", "adapter.depth_groups", "quant.projections",
        "quant.depth_groups", "grid")
# Overlapping depth groups apply in the order written, the later winning (qft.layers.resolve): their order is part
# of what a run computes, so the hash keeps it.
ORDERED = (("adapter", "depth_groups"), ("quant", "depth_groups"))


def _any_typed(cls, typed=Any, leave_out: tuple = ()):
    """The class as Hydra is given it: every field typed Any, so a value stays as written and qft's own check
    names what is wrong with it (OmegaConf would turn `no` into false and refuse 2.5 in its own words); with
    `typed=None` the fields keep their types. `leave_out`: the fields a narrower shape lacks."""
    fields = [(f.name, f.type if typed is None else typed, dataclasses.field(default=f.default, metadata=f.metadata)
               if f.default is not dataclasses.MISSING else
               dataclasses.field(default_factory=f.default_factory, metadata=f.metadata))
              for f in dataclasses.fields(cls) if f.name not in leave_out]
    return dataclasses.make_dataclass(cls.__name__, fields)


@functools.cache
def shapes(group: str) -> dict:
    """{name: schema class} a preset of the config `group` can extend: its classes and each class's narrower SHAPES."""
    out = dict(GROUPS.get(group, {}))
    for cls in GROUPS.get(group, {}).values():
        out.update({name: _any_typed(cls, None, left) for name, left in getattr(cls, "SHAPES", {}).items()})
    return out


def top_defaults() -> dict:
    """The top level's keys and sections at their defaults, as conf/config.yaml extends them (less what Top's
    shape leaves out)."""
    out = {k.path: k.default for k in keys_of(G.Top, "") if k.path not in G.Top.SHAPES["_top"]}
    for section, cls in TOP.items():
        if section:
            out[section] = {k.path.split(".")[-1]: k.default for k in keys_of(cls, f"{section}.")}
    return out


def register() -> None:
    """Store the schemas in Hydra's ConfigStore (before any compose)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group in GROUPS:
        for name, cls in shapes(group).items():
            cs.store(group=group, name=name, node=_any_typed(cls), provider="qft")
    cs.store(name="_top", node=top_defaults(), provider="qft")


@functools.cache
def keys() -> dict[str, Key]:
    """Every declared key by its dotted path (a group's shapes together; the first shape's declaration wins)."""
    out: dict[str, Key] = {}
    for section, cls in TOP.items():
        for k in keys_of(cls, f"{section}." if section else ""):
            out.setdefault(k.path, k)
    for group, schemas in GROUPS.items():
        for cls in schemas.values():
            for k in keys_of(cls, f"{group}."):
                out.setdefault(k.path, k)
    return out


def defaults(section: str) -> dict:
    """{key: default} of the config `section` (its first shape's), for code that builds a config without Hydra."""
    cls = TOP[section] if section in TOP else next(iter(GROUPS[section].values()))
    return {k.path: k.default for k in keys_of(cls, "")}


def classes() -> list:
    """Every schema class, nested ones (a layer type's settings, a random model's tokenizer) included."""
    out = [*TOP.values(), *(c for s in GROUPS.values() for c in s.values())]
    return out + [k.of for k in keys().values() if k.of is not None and k.of not in out]


def sections() -> dict[str, list]:
    """Each group and top-level section with its schema classes."""
    return {**{g: list(s.values()) for g, s in GROUPS.items()}, **{s: [c] for s, c in TOP.items() if s}}


def declared() -> dict[str, frozenset]:
    """The keys declared under each path ('' is the top): every shape's and every preset-only key."""
    out: dict[str, set] = {"": set(PRESET_ONLY)}
    nested = [f"{k.path}.{n.path}" for k in keys().values() if k.of is not None for n in keys_of(k.of, "")]
    for path in [*keys(), *nested]:
        parent, _, name = path.rpartition(".")
        out.setdefault(parent, set()).add(name)
        while parent:
            parent, _, name = parent.rpartition(".")
            out.setdefault(parent, set()).add(name)
    return {k: frozenset(v) for k, v in out.items()}


def allowed(path: str) -> tuple:
    """The values the Choice of the key at dotted `path` allows (None for a key without one)."""
    return keys()[path].allowed


def check(node, section: str, only=None) -> None:
    """Run the declared check of every key of `section` the node holds (or of `only`), in declaration order: a bad
    value raises QftError naming the key, the value and what is allowed."""
    for k in keys().values():
        parent, _, name = k.path.rpartition(".")
        if parent == section and k.check is not None and name in node and (only is None or name in only):
            k.check(k.path, node[name])


def not_hashed() -> frozenset:
    """The config paths left out of the config hash: keys declared hashed=False, whole sections that are, and the
    preset-only grid."""
    out = {tuple(k.path.split(".")) for k in keys().values() if not k.hashed}
    out -= {p for p in out if p[0] in _unhashed_sections()}
    retired = {tuple(p.split(".")) for p in RETIRED}
    return frozenset(out | retired | {(s,) for s in _unhashed_sections()} | {(p,) for p in PRESET_ONLY})


def _unhashed_sections() -> set:
    return {s for s, classes in sections().items() if not all(getattr(c, "HASHED", True) for c in classes)}


def hashed_with() -> dict:
    """Keys an older record lacks and is hashed with, at the value it meant (`old_hash="with"`)."""
    return {tuple(k.path.split(".")): k.before for k in keys().values() if k.old_hash == "with"}


def hashed_without() -> dict:
    """Keys left out of the hash at the value that computes what records before them computed (`old_hash="without"`)."""
    return {tuple(k.path.split(".")): k.before for k in keys().values() if k.old_hash == "without"}


def exclude_keys() -> list[str]:
    """The override keys a sweep's directory name leaves out (conf/config.yaml's override_dirname), as the hash does:
    every key outside the hash, a section outside it with each of its keys, and the presets that only say how."""
    out = ["experiment", "+experiment", "scale", "hydra.launcher.n_jobs"]
    unhashed = _unhashed_sections()
    for k in keys().values():
        if (not k.hashed or k.path.split(".")[0] in unhashed) and k.path not in out:
            out.append(k.path)
    return out + list(RETIRED) + sorted(unhashed - set(out))


def loaded(config: dict) -> dict:
    """A record's `config` (a dict) as a run of today reads it: a copy in which every declared key of a section it
    holds, that it lacks, is filled at the value an older record meant (`before`). The one place an older record's
    meaning is applied (predict, the report, resume)."""
    conf = copy.deepcopy(config)
    for section, classes in sections().items():  # a section all of whose keys say what its absence meant
        if section not in conf and all(k.before is not NONE for c in classes for k in keys_of(c, "")):
            conf[section] = {}
    for k in keys().values():
        if k.before is NONE:
            continue
        *parents, name = k.path.split(".")
        node = conf
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and name not in node:
            node[name] = copy.deepcopy(k.before)
    return conf


def complete(cfg):
    """The composed config `cfg`, completed in place and returned: each declared key its presets left out (a narrower
    shape, an absent section such as budget=none) at its declared default; an absent OPTIONAL section
    (evaluate=none) stays absent. The one place a live config gets those keys: the run, the CLIs' compose and
    Hydra's dry run call it before they read the config, so a record holds every key at the value used."""
    from omegaconf import open_dict

    def fill(node, cls) -> None:
        with open_dict(node):
            for k in keys_of(cls, ""):
                if k.path not in node:
                    node[k.path] = copy.deepcopy(k.default)

    fill(cfg, G.Top)
    for section, classes in sections().items():
        if section not in cfg:
            if getattr(classes[0], "OPTIONAL", False):
                continue
            with open_dict(cfg):
                cfg[section] = {}
        elif len(classes) > 1:  # a model's or logger's shape is its preset's own
            continue
        fill(cfg[section], classes[0])
    return cfg


def cpu_only(section: str) -> tuple:
    """The keys of the config `section` only a CPU run reads, in declaration order."""
    return tuple(k.path.rpartition(".")[2] for k in keys().values() if k.cpu_only and k.path.startswith(section + "."))


def accel_mode(cfg, device: str) -> str:
    """accel.mode of the config `cfg` as a run on `device` ("cpu", "cuda", "cuda:1" or a torch.device) takes it:
    auto is cpu on a CPU, off on CUDA."""
    mode = cfg.accel.mode
    on_cpu = str(getattr(device, "type", device)).split(":")[0] == "cpu"
    return ("cpu" if on_cpu else "off") if mode == "auto" else mode


def accel_switches(cfg, device) -> dict:
    """{switch: value} of the speed switches (accel.*) of the config `cfg` as a run on `device` ("cpu" or "cuda")
    takes them: each one set overrides the mode's value. The one place the speed layer reads them from."""
    mode = accel_mode(cfg, device)
    out = {}
    for k in keys().values():
        section, _, name = k.path.rpartition(".")
        if section == "accel" and name != "mode":
            value = cfg.accel[name]
            out[name] = getattr(k, mode) if value is None else value
    return out
