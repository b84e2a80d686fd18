"""The config's home: where the Hydra tree lives, which keys it declares, how a CLI composes it (and words
Hydra's errors), and which device it names.

It imports no config group's module, so every module (the group modules' own CLIs included) can import it;
checking the whole config is qft.validate's.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from pathlib import Path

from qft import schema
from qft.errors import QftError

DEVICES = schema.allowed("device")
CONF = str(Path(__file__).resolve().parent.parent / "conf")  # the Hydra config tree: presets over qft.schema's keys
OPEN = schema.OPEN  # maps whose keys the user names
HEADER = re.compile(r"#\s*@package\s+(\S+)")


def equal_shares(split: str) -> list[int]:
    """budget.shares' default: `split`'s group count of equal weights ([1, 1] for type, [1, 1, 1] for depth), so a depth
    split needs no shares of its own; a run's record holds the list it resolved to."""
    return [1, 1, 1] if split == "depth" else [1, 1]


def _register() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("qft_equal_shares", equal_shares, replace=True)
    OmegaConf.register_new_resolver("qft_exclude_keys", schema.exclude_keys, replace=True)
    schema.register()


_register()  # before any compose: every CLI and test composes through this module's CONF


def _package(text: str) -> str:
    """A config file's package, from the `# @package` line of its leading comments, as Hydra reads it."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            break
        m = HEADER.match(line)
        if m:
            return m.group(1)
    return "_group_"  # Hydra's default: a group's file is its package (conf/train/gpu.yaml -> train)


def declared() -> dict[str, frozenset]:
    """The keys qft.schema declares under each path ('' is the top), over every shape of every group.

    Hydra refuses a key the chosen presets lack unless it is appended with `+`; this is what makes an appended
    typo (`+train.stpes=5`) an error rather than a run on the defaults."""
    return schema.declared()


@functools.cache
def _tree() -> tuple[dict[str, frozenset], dict[str, list[str]]]:
    """The keys each preset declares under each path, and the presets that declare each dotted key (`logger.dir` ->
    [`logger=tensorboard`])."""
    import yaml

    nodes = []
    for f in sorted(Path(CONF).rglob("*.yaml")):
        group = f.relative_to(CONF).parts[:-1]
        if group[:1] == ("hydra",):
            continue
        text = f.read_text()
        package = _package(text)
        path = () if package == "_global_" else group if package == "_group_" else tuple(package.split("."))
        preset = f"{'+' if group == ('experiment',) else ''}{'/'.join(group)}={f.stem}" if group else "config.yaml"
        content = yaml.safe_load(text) or {}
        extends = [d for d in content.get("defaults") or [] if isinstance(d, str)]
        own = {s: c for s, c in schema.shapes("/".join(group)).items() if s in extends}
        for cls in own.values():  # a preset extending a schema declares the schema's keys
            content = {**{k.path: k.default for k in schema.keys_of(cls, "")}, **content}
        nodes.append((preset, path, content))
    return _walk(nodes)


def _walk(nodes) -> tuple[dict[str, frozenset], dict[str, list[str]]]:
    """The keys declared under each path by (preset, package path, content) triples, and who declares each key."""
    out, origin = defaultdict(set), defaultdict(list)

    def walk(path: str, node: dict, preset: str) -> None:
        for key, value in node.items():
            out[path].add(key)
            sub = f"{path}.{key}" if path else key
            origin[sub].append(preset)
            if isinstance(value, dict) and sub not in OPEN:
                walk(sub, value, preset)

    for preset, package, node in nodes:
        node = {k: v for k, v in node.items() if k not in ("defaults", "hydra")}
        for part in reversed(package):
            node = {part: node}
        walk("", node, preset)
    return {k: frozenset(v) for k, v in out.items()}, dict(origin)


def chosen(overrides, config_name: str = "config") -> dict[str, frozenset] | None:
    """The keys the presets chosen by `overrides` give the config of `config_name` (what Hydra composes from them less
    the keys they append), where an override appends one (`+model.seed=5` on a model whose preset has no seed);
    None where none does, or outside Hydra. Pass Hydra's overrides too (`hydra.searchpath`)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not GlobalHydra.instance().is_initialized():
        return None
    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    appended = {o.key_or_group for o in parsed if (o.is_add() or o.is_force_add()) and not o.is_hydra_override()
                and not loader.repository.group_exists(o.key_or_group)}
    if not appended:
        return None
    kept = [o.input_line for o in parsed if o.key_or_group not in appended]  # and what later changes or deletes them
    try:  # completed, as the run completes its own config
        base = OmegaConf.to_container(schema.complete(loader.load_configuration(config_name, kept, RunMode.RUN)),
                                      resolve=False)
    except Exception:  # noqa: BLE001 - what they leave does not compose alone: the check over every preset stands
        return None
    keys = _walk([("chosen", (), base)])[0]
    # the outlier threshold is read by an 8-bit layer, whichever preset made it one (quant.attn.bits=8)
    return {**keys, **{p: keys[p] | {"threshold"} for p in ("quant.attn", "quant.mlp")
                       if p in keys and (base["quant"][p.split(".")[1]] or {}).get("bits") == 8}}


def job_keys(hydra_cfg) -> dict[str, frozenset] | None:
    """chosen() for the Hydra job whose config is `hydra_cfg`, from its own overrides (Hydra's included), as the task
    function and the dry-run launcher see them."""
    return chosen([*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task], hydra_cfg.job.config_name)


def _unknown(path: str, keys: dict[str, frozenset] | None = None, key: str | None = None) -> str:
    if key in schema.RETIRED:  # an older record's name for it
        return f"moved to {schema.RETIRED[key]}"
    return f"unknown key; allowed under {path or 'the top level'}: {', '.join(sorted((keys or declared())[path]))}"


def _elsewhere(key: str) -> str | None:
    """Where a key other presets declare is put on presets without it: appending it would change nothing."""
    presets = sorted(set(_tree()[1].get(key, [])))
    return f"not a key of the chosen presets; it is one of {', '.join(presets)}" if presets else None


def check_keys(cfg, path: str = "", keys: dict[str, frozenset] | None = None) -> None:
    """Raise QftError unless every key of the composed `cfg` (under `path`) is one some preset declares where it
    stands, and where `keys` (chosen()) says which presets were chosen, one they declare; the error names the key
    and the presets that hold it."""
    from omegaconf import DictConfig

    for key, value in cfg.items_ex(resolve=False):
        where = f"{path}.{key}" if path else str(key)
        if key not in declared()[path]:
            raise QftError(where, value, _unknown(path, key=where))
        if keys is not None and key not in keys[path]:
            raise QftError(where, value, _elsewhere(where) or _unknown(path, keys))
        if isinstance(value, DictConfig) and where in declared() and (keys is None or where in keys):
            check_keys(value, where, keys)


def one_line(e: Exception) -> str:
    """Hydra's override error `e` as one line; an unknown key names the keys allowed where it was put."""
    text = " ".join(str(e).split("Config search path")[0].split())  # Hydra appends its search path: noise here
    typo = re.search(r"Key '[^']+' not in '[^']+' full_key: (\S+)", text)
    if typo:  # a preset's key its group's schema does not declare (a user's own preset on hydra.searchpath)
        parent = typo.group(1).rpartition(".")[0]
        return f"{typo.group(1)}: {_unknown(parent)}" if parent in declared() else text
    m = re.match(r"Could not override '([^']+)'", text)
    parts = m.group(1).split(".") if m else []
    if parts[:1] == ["hydra"] or (len(parts) == 1 and (Path(CONF) / parts[0]).is_dir()):
        return text  # Hydra's own settings, or a config group not chosen by default (scale=...): Hydra's advice holds
    path = ""
    for part in parts:
        allowed = declared().get(path)
        if path in OPEN or allowed is None:
            break
        if part not in allowed:
            return f"{m.group(1)}: {_unknown(path, key=m.group(1))}"
        path = f"{path}.{part}" if path else part
    elsewhere = _elsewhere(m.group(1)) if m else None
    if elsewhere:
        return f"{m.group(1)}: {elsewhere}"
    return text  # a name in a user-named map (projections, label words, ...): Hydra's advice to append it holds


def device(cfg, planning: bool = False) -> str:
    """The device ("cpu" or "cuda") the config `cfg` runs on: device=auto takes CUDA where visible. Raises QftError
    (device) on another value, or on device=cuda without a GPU unless `planning` (the memory model sizing a GPU
    run from any machine)."""
    import torch

    if cfg.device not in DEVICES:
        raise QftError("device", cfg.device, f"allowed: {', '.join(DEVICES)}")
    if cfg.device == "cuda" and not planning and not torch.cuda.is_available():
        raise QftError("device", "cuda", "no CUDA device is visible; use device=cpu or device=auto")
    return ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device


def compose(argv, prog: str, doc: str = ""):
    """The config Hydra composes from the command line `argv` (None: sys.argv), completed (qft.schema.complete), or
    None once Hydra's or the key check's error is printed as one line prefixed by `prog`. `-h`/`--help` prints the
    usage and `doc` and exits 0 (Hydra's parser would read it as a bad override)."""
    import sys

    from hydra import compose as hydra_compose, initialize_config_dir

    overrides = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(overrides):
        print(f"usage: python -m {prog} [KEY=VALUE ...]\n\n{doc.strip()}\n\nKEY=VALUE: Hydra overrides of the config "
              "tree conf/, as python -m qft takes them (python -m qft --help lists its groups, python -m qft --cfg job "
              "the keys of the chosen presets and their values).")
        sys.exit(0)
    with initialize_config_dir(CONF, version_base="1.3"):
        try:
            cfg = hydra_compose("config", overrides=overrides)
        except Exception as e:  # noqa: BLE001 - Hydra's override errors, as one line
            print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
            return None
        try:
            check_keys(cfg, keys=chosen(overrides))
        except QftError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return None
    return schema.complete(cfg)
