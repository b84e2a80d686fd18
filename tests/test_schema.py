"""One declaration per config key (qft/schema): what Hydra composes, what is checked, hashed, loaded from older records
and documented all come from it, and a key declared elsewhere, without help, or read with a second default fails."""

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qft import config, record, schema
from qft.errors import QftError
from qft.schema.spec import NONE, Int, key

ROOT = Path(__file__).resolve().parent.parent


def test_every_declared_key_has_one_line_of_help():
    assert {c.__name__: schema.undocumented(c) for c in schema.classes() if schema.undocumented(c)} == {}
    assert len(schema.keys()) >= 90


def test_a_key_without_help_is_found():
    @dataclasses.dataclass
    class Train:
        steps: int = key(100, "optimizer steps", Int(1))
        label_smoothing: float = key(0.0, "")
        warmup: int = 10  # not declared through key(): no help either
        note: str = key("x", "two\nlines")

    assert schema.undocumented(Train) == ["label_smoothing", "warmup", "note"]


def _defaulted_gets(path: Path) -> list[str]:
    """`X.get("<declared key>", default)` where X reads a config (its text names cfg or conf): a second default."""
    names = {p.rpartition(".")[2] for p in schema.keys()}
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in names \
                and re.search(r"cfg|conf", ast.unparse(node.func.value)):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_second_default_for_a_declared_key_in_qft():
    assert [hit for p in sorted((ROOT / "qft").rglob("*.py")) for hit in _defaulted_gets(p)] == []


def test_a_second_default_is_found(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("def f(cfg, rec):\n    a = cfg.quant.get('cache_quantized', True)\n"
                 "    b = rec.get('status', 'ok')\n    return cfg.adapter.get('dropout_mask')\n")
    assert _defaulted_gets(f) == ["mod.py:2: cfg.quant.get('cache_quantized', True)"]


def test_an_undeclared_key_fails_with_one_line_and_status_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "qft", "model=tiny_llama", "+train.label_smoothing=0.1",
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "qft: error: train.label_smoothing=0.1: unknown key; allowed under train: " + ", ".join(sorted(
            config.declared()["train"]))]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_a_preset_key_the_schema_lacks_fails_as_hydra_composes(tmp_path):
    from hydra import compose, initialize_config_dir

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "mine.yaml").write_text("defaults: [cpu_small, _self_]\nlabel_smoothing: 0.1\n")
    with initialize_config_dir(config.CONF, version_base="1.3"), pytest.raises(Exception) as e:
        compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "train=mine"])
    assert config.one_line(e.value).startswith("train.label_smoothing: unknown key; allowed under train: batch_size, ")


def test_the_hash_tables_are_the_schemas_and_as_before():
    """Derived from the declarations, and equal to the tables every committed record was hashed with."""
    assert record._NOT_HASHED == {
        ("train", "resume"), ("train", "stop_after_steps"), ("train", "host_allocator"), ("train", "eval_every"),
        ("train", "fuse_projections"), ("train", "compiled_masks"), ("train", "compiled_sums"),
        ("train", "compiled_rope"), ("train", "split_rows"), ("train", "checkpoint_every"),
        ("train", "eval_batch_size"), ("train", "zero_shot"), ("experiment",), ("cache_dir",), ("sweep",), ("grid",),
        ("logger",), ("quant", "cache_dequantized"), ("quant", "cache_quantized"), ("offload",),
        ("budget", "bits_records"), ("accel",)}  # the speed switches' own section, as their old places
    assert record._THEN == {("adapter", "dropout_mask"): "torch"}
    assert record._ABSENT_AT == {("adapter", "shared_dropout"): False, ("quant", "attention_dtype"): "compute",
                                 ("data", "test_stream"): "shared"}


def test_sweep_directory_names_leave_out_what_the_hash_does():
    from hydra import compose, initialize_config_dir

    keys = schema.exclude_keys()
    hashed_out = {".".join(p) for p in record._NOT_HASHED}
    assert {k for k in keys if k in schema.keys()} == {p for p in schema.keys() if p in hashed_out or
                                                       p.split(".")[0] in hashed_out}
    with initialize_config_dir(config.CONF, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "adapter.attn.r=2", "train.eval_every=3", "offload.device_budget_gb=4", "sweep.force=true",
            "train.lr=0.01"])
    assert cfg.hydra.job.override_dirname == "adapter.attn.r=2,train.lr=0.01"


def test_an_older_record_is_loaded_as_it_meant():
    old = {"adapter": {"attn": {"r": 8, "alpha": 16}}, "data": {"source": "bbc_news"},
           "quant": {"compute_dtype": "auto"}, "budget": {"params": None}, "model": {"name": "x"}}
    new = schema.loaded(old)
    assert new["adapter"]["dropout_mask"] == "torch" and new["adapter"]["shared_dropout"] is False
    assert new["quant"]["attention_dtype"] == "compute" and new["accel"]["mode"] == "auto"
    assert (new["data"]["test_stream"], new["data"]["stratify"]) == ("shared", "balanced")
    assert new["budget"]["method"] == "shares" and "train" not in new and new["model"] == {"name": "x"}
    assert "dropout_mask" not in old["adapter"]  # the record itself is left as written
    assert schema.loaded({"adapter": {"dropout_mask": "fast"}})["adapter"]["dropout_mask"] == "fast"


def test_every_committed_record_loads_with_every_key_of_its_sections():
    """A key added after records existed declares what they meant: loaded, each committed record's config holds every
    key of each section it has (the sections of one shape; a model's or logger's shape is the preset's own)."""
    single = {s for s, c in schema.sections().items() if len(c) == 1}
    lacking = set()
    configs = [json.loads(p.read_text()).get("config") for p in sorted((ROOT / "results").rglob("result.json"))]
    configs = [schema.loaded(c) for c in configs if c]
    assert len(configs) > 100
    for conf in configs:
        for path in schema.keys():
            section, _, name = path.rpartition(".")
            if section in single and isinstance(conf.get(section), dict) and name not in conf[section]:
                lacking.add(path)
    assert lacking == set()


def test_each_preset_extends_its_schema_and_repeats_no_default():
    """A preset names its group's schema (or another preset) first and sets only what differs from the schema."""
    for group in schema.GROUPS:
        schemas = schema.shapes(group)
        for f in sorted((Path(config.CONF) / group).glob("*.yaml")):
            content = yaml.safe_load(f.read_text()) or {}
            extends = [d for d in content.get("defaults") or [] if isinstance(d, str) and d != "_self_"]
            if not extends:
                assert content == {} and "@package _global_" in f.read_text(), f  # evaluate=none: no section at all
                continue
            assert extends[0] in schemas or (Path(config.CONF) / group / f"{extends[0]}.yaml").is_file(), f
            if extends[0] in schemas:
                inherited = {k.path: k.default for k in schema.keys_of(schemas[extends[0]], "")}
            else:  # what the preset it extends composes to (conf/train/gpu.yaml repeats none of cpu_small's)
                inherited = _composed(group, extends[0])
            assert {k: v for k, v in content.items() if k in inherited and inherited[k] == v} == {}, f


def _composed(group: str, preset: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config.CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=[f"{group}={preset}"])[group])


def test_the_speed_layer_is_one_choice_by_device_with_expert_overrides():
    from conftest import make_cfg

    cfg = make_cfg()
    assert cfg.accel.mode == "auto" and set(schema.cpu_only("accel")) == {
        "fuse_projections", "compiled_masks", "compiled_sums", "compiled_rope", "split_rows"}
    assert schema.accel_switches(cfg, "cpu") == {
        "host_allocator": "tuned", "fuse_projections": True, "compiled_masks": True, "compiled_sums": True,
        "compiled_rope": True, "split_rows": True, "cache_quantized": True, "cache_dequantized": False}
    stock = {**dict.fromkeys(schema.accel_switches(cfg, "cpu"), False), "host_allocator": "default"}
    assert schema.accel_switches(cfg, "cuda") == stock
    assert schema.accel_switches(make_cfg("accel=cpu"), "cuda") == schema.accel_switches(cfg, "cpu")
    assert schema.accel_switches(make_cfg("accel=off", "accel.split_rows=true"), "cpu") == {**stock, "split_rows": True}
    assert record.config_hash(make_cfg("accel=off")) == record.config_hash(cfg)  # outside the hash
    with pytest.raises(QftError, match=r"accel.split_rows='yes': true, false or null"):
        from qft import validate

        validate.validate(make_cfg("accel.split_rows=yes"))


def test_an_old_switch_name_says_where_it_moved():
    assert config.compose(["train.fuse_projections=false"], "qft") is None
    with pytest.raises(QftError, match=r"^quant.cache_quantized=False: moved to accel.cache_quantized$"):
        from conftest import make_cfg

        config.check_keys(make_cfg("+quant.cache_quantized=false"))


def test_an_older_record_with_the_switches_in_train_loads_and_keeps_its_hash():
    from omegaconf import OmegaConf

    old = next(r for r in (json.loads(p.read_text()) for p in sorted((ROOT / "results").rglob("result.json")))
               if "fuse_projections" in (r.get("config") or {}).get("train", {}) and r.get("config_hash"))
    assert record.config_hash(old["config"], inputs_=old["inputs"]) == old["config_hash"]
    cfg = OmegaConf.create(schema.loaded(old["config"]))
    assert schema.accel_switches(cfg, "cpu")["fuse_projections"] is True  # this machine's speed layer: auto


def test_a_bad_value_gets_the_declared_check():
    from conftest import make_cfg

    from qft import validate

    for overrides, line in [(["train.zero_shot=no"], "train.zero_shot='no': true or false"),
                            (["offload=pipeline", "offload.schedule=zb"],
                             "offload.schedule='zb': allowed: gpipe, 1f1b"),
                            (["train.stop_after_steps=0"], "train.stop_after_steps=0: an integer >= 1, or null"),
                            (["quant.attention_dtype=fp16"], "quant.attention_dtype='fp16': allowed: compute, fp32")]:
        with pytest.raises(QftError) as e:
            validate.validate(make_cfg(*overrides))
        assert str(e.value) == line


def test_the_readme_lists_every_group_its_presets_and_default():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Config groups"):].split("\n\n")[2]
    rows = {r.split("|")[1].strip().strip("`"): [c.strip() for c in r.split("|")[2:-1]]
            for r in table.splitlines()[2:]}
    primary = yaml.safe_load((Path(config.CONF) / "config.yaml").read_text())["defaults"]
    chosen = {k: v for d in primary if isinstance(d, dict) for k, v in d.items()}
    for group in schema.GROUPS:
        what, presets, default = rows[group]
        named = set(re.findall(r"`([\w]+)`", presets))
        assert named >= {f.stem for f in (Path(config.CONF) / group).glob("[!_]*.yaml")}, group
        assert default == f"`{chosen[group]}`", group
        for name in re.findall(r"`([a-z]+_[a-z_]+)`", what):  # keys the row names are keys of the group
            assert name in config.declared()[group], (group, name)



def _leaves(node, path: str = "") -> list[str]:
    """Dotted paths of a config's leaves: every value that is no map, and every empty map."""
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    return [path]


_ABSENT = object()


def _at(conf: dict, path: str):
    for part in path.split("."):
        if not isinstance(conf, dict) or part not in conf:
            return _ABSENT
        conf = conf[part]
    return conf


def _hydra_cfg(*overrides):
    """The config as Hydra composes it (what `python -m qft --cfg job` prints), before a run completes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config.CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_default_config_has_at_most_60_leaf_keys_outside_the_speed_switches():
    from omegaconf import OmegaConf

    switches = {p for p, k in schema.keys().items() if p.startswith("accel.") and k.cpu is not NONE}
    assert len(switches) == 8  # the accel choice's expert overrides: each null, the mode's value
    leaves = [p for p in _leaves(OmegaConf.to_container(_hydra_cfg())) if p not in switches]
    assert len(leaves) <= 60, sorted(leaves)
    assert not {"budget", "logger", "experiment"} & {p.split(".")[0] for p in leaves}


@pytest.mark.parametrize("overrides", [[], ["offload=activations"], ["data=reuters_r8", "adapter=deep2"],
                                       ["budget=uniform", "budget.params=20000"], ["+experiment=smoke"]])
def test_a_run_completes_the_config_with_every_key_its_presets_leave_out(overrides):
    """The keys a narrower shape (offload=none, a packaged dataset, adapter and quant without maps) or an absent
    section (budget=none, logger=none) leaves out are filled at their defaults: a run and its record see every key,
    and the hash is the one a config holding them all had."""
    from omegaconf import OmegaConf

    composed = OmegaConf.to_container(_hydra_cfg(*overrides))
    done = OmegaConf.to_container(schema.complete(_hydra_cfg(*overrides)))
    filled = set(_leaves(done)) - set(_leaves(composed))
    single = [s for s, c in schema.sections().items() if len(c) == 1 and s != "evaluate"]
    wanted = {p for p in schema.keys() if p.split(".")[0] in single or "." not in p} | {"logger.kind"}
    assert {p for p in wanted if _at(done, p) is _ABSENT} == set() and filled <= wanted
    for path in filled:  # each at its declared default, the rest as composed
        assert _at(done, path) == schema.keys()[path].default, path
    if not overrides:  # the default config: every key the presets leave out, and the hash as every record holds it
        assert sorted(filled) == sorted(
            ["experiment", "data.path", "data.text_column", "data.label_column", "quant.projections",
             "quant.depth_groups", "adapter.projections", "adapter.depth_groups", "offload.stages", "offload.schedule",
             "offload.micro_batches", "offload.split", "offload.offload_stages", "offload.route", "offload.prefetch",
             "logger.kind", *(f"budget.{k}" for k in ("params", "split", "shares", "tolerance", "grid", "method",
                                                      "records", "records_data", "max_rank", "bits_records"))])
        resolved = OmegaConf.to_container(schema.complete(_hydra_cfg()), resolve=True)
        assert record.config_hash(resolved, inputs_={}) == \
            "0925cf61ceabad70330d776e51cc6a6d9c2e7079dbc3f52da16282d1d50e7de3"  # the default config's, as before


def test_a_key_the_chosen_shape_lacks_fails_with_one_line_naming_the_preset(tmp_path):
    for override, line in [("offload.stages=2", "offload.stages: not a key of the chosen presets; it is one of "
                                                 "offload=pipeline"),
                           ("data.path=x.csv", "data.path: not a key of the chosen presets; it is one of data=alpaca, "
                                               "data=local, data=paper_alpaca")]:
        res = subprocess.run([sys.executable, "-m", "qft", "model=tiny_llama", override, f"hydra.run.dir={tmp_path}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert (res.returncode, res.stderr.strip().splitlines()) == (2, [f"qft: error: {line}"])
        assert not (tmp_path / "result.json").exists()
