import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qft import model, record, run, validate
from qft.errors import QftError
from conftest import TINY_DATA, make_cfg

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    ("adapter.attn.r=-1", "adapter.attn.r"),
    ("adapter.mlp.r=2.5", "adapter.mlp.r"),
    ("adapter.mlp.alpha=0", "adapter.mlp.alpha"),
    ("adapter.dropout=1.5", "adapter.dropout"),
    ("adapter.dropout_mask=bernoulli", "adapter.dropout_mask"),
    ("accel.host_allocator=jemalloc", "accel.host_allocator"),
    ("+adapter.conv={r:4,alpha:8}", "adapter.conv"),
    ("+adapter.projections.qkv_proj={r:4}", "adapter.projections.qkv_proj"),
    ("+adapter.attn.rank=4", "adapter.attn.rank"),
    ("+adapter.depth_groups.deep={layers:[2,40],r:4}", "adapter.depth_groups.deep.layers"),
    ("+adapter.depth_groups.deep={layers:[3,1],r:4}", "adapter.depth_groups.deep.layers"),
    ("+quant.depth_groups.top={layers:[0,4],bits:8}", "quant.depth_groups.top.layers"),
    ("quant.attn.bits=3", "quant.attn.bits"),
    ("quant.mlp.quant_type=int4", "quant.mlp.quant_type"),
    ("quant.mlp.block_size=100", "quant.mlp.block_size"),
    ("quant.compute_dtype=fp8", "quant.compute_dtype"),
    ("quant.compute_dtype=fp16", "quant.compute_dtype"),  # no loss scaling: fp16 training is refused
    ("data.stratify=random", "data.stratify"),
    ("data.split_seed=0.5", "data.split_seed"),
    ("train.optimizer=adamw8bit", "train.optimizer"),
    ("train.lr=-1", "train.lr"),
    ("device=tpu", "device"),
    ("data.source=imdb", "data.source"),
    ("data.max_length=20", "data.max_length"),
    ("model.path=/nonexistent/model", "model.path"),
    ("data=local", "data.path"),
    ("seed=1.5", "seed"),
    ("train.schedule=exponential", "train.schedule"),
    ("train.resume=maybe", "train.resume"),
    ("train.steps=0", "train.steps"),
    ("adapter.use_rslora=maybe", "adapter.use_rslora"),
    ("data.task=qa", "data.task"),
    ("+data.label_words={no_such_label:x}", "data.label_words"),
    (("offload=activations", "offload.prefetch=maybe"), "offload.prefetch"),
    ("offload.device_budget_gb=0", "offload.device_budget_gb"),
    ("offload.device_budget_gb=-4", "offload.device_budget_gb"),
    (("budget=shares", "budget.params=-5"), "budget.params"),
    ("model.source=hub", "model.source"),
    # appended keys the tree declares nowhere: Hydra takes them, so qft refuses them (a typo would run the defaults)
    ("+train.stpes=5", "train.stpes"),
    ("+data.foo=1", "data.foo"),
    ("+model.tokenizer.revision=main", "model.tokenizer.revision"),
    ("+offload.stage=2", "offload.stage"),
    ("+budget.param=5000", "budget.param"),
    ("+seeds=3", "seeds"),
    # values of the wrong kind: a string read as true, an unbounded number, a scalar where a map or list belongs
    ("+model.trust_remote_code=no", "model.trust_remote_code"),
    ("train.gradient_checkpointing=no", "train.gradient_checkpointing"),
    ("train.zero_shot=no", "train.zero_shot"),
    ("sweep.force=no", "sweep.force"),
    ("sweep.blind=maybe", "sweep.blind"),
    ("data.test_stream=maybe", "data.test_stream"),
    ("train.resume=1", "train.resume"),
    ("train.max_grad_norm=-1", "train.max_grad_norm"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.lr=inf", "train.lr"),
    ("adapter.dropout=abc", "adapter.dropout"),
    ("seed=-1", "seed"),
    ("cache_dir=null", "cache_dir"),
    ("model.seed=abc", "model.seed"),
    ("model.arch=abc", "model.arch"),
    ("+model.arch.num_hiden_layers=2", "model.arch.num_hiden_layers"),  # transformers would keep it, unread
    ("model.arch.model_type=lama", "model.arch.model_type"),
    ("quant.attn=null", "quant.attn"),
    ("adapter.attn=5", "adapter.attn"),
    ("+adapter.projections=abc", "adapter.projections"),  # lora holds no maps: appended, then refused
    ("+adapter.projections.q_proj=5", "adapter.projections.q_proj"),
    ("+adapter.depth_groups.x=5", "adapter.depth_groups.x"),
    ("+adapter.depth_groups.x={layers:7,r:2}", "adapter.depth_groups.x.layers"),
    ("+adapter.depth_groups.x={layers:[0,1],types:mlp,r:2}", "adapter.depth_groups.x.types"),
    ("data.min_text_tokens=0", "data.min_text_tokens"),
    ("data.label_words=[1,2]", "data.label_words"),
    ("data.instruction=7", "data.instruction"),
    ("data.instruction='Choose one of {label}.'", "data.instruction"),
    ("data.instruction='Choose one of {labels[0]}.'", "data.instruction"),
    ("data.instruction='Choose one of {labels!r}.'", "data.instruction"),
    ("model.tokenizer.package=null", "model.tokenizer.package"),
    ("+logger.dir=7", "logger.dir"),
    (("offload=pipeline", "offload.split=5"), "offload.split"),
    (("offload=pipeline", "offload.offload_stages=[a]"), "offload.offload_stages"),
    (("budget=shares", "budget.grid=[1,x]"), "budget.grid"),
]


@pytest.mark.parametrize("override,key", CASES)
def test_bad_config_names_the_key_and_records_failure(tmp_path, override, key):
    cfg = make_cfg(*TINY_DATA, "train.steps=1", *(override if isinstance(override, tuple) else (override,)))
    with pytest.raises(QftError) as e:
        run.run(cfg, tmp_path)
    assert e.value.key == key
    assert str(e.value).startswith(f"{key}=") and "\n" not in str(e.value)
    rec = record.read(tmp_path)
    assert rec["status"] == "failed" and key in rec["error"]


@pytest.mark.parametrize("override,key", [("budget.tolerance=0", "budget.tolerance"),
                                          ("budget.tolerance=abc", "budget.tolerance"),
                                          ("budget.shares=5", "budget.shares"),
                                          ("budget.params=inf", "budget.params"),
                                          ("budget.tolerance=1.5", "budget.tolerance"),
                                          ("budget.shares=[1]", "budget.shares"),
                                          ("budget.shares=[-1,2]", "budget.shares")])
def test_bad_budget_settings_name_the_key(tmp_path, override, key):
    with pytest.raises(QftError) as e:  # checked only while a budget is set
        run.run(make_cfg(*TINY_DATA, "budget=shares", "budget.params=20000", override), tmp_path)
    assert e.value.key == key and record.read(tmp_path)["status"] == "failed"


@pytest.mark.parametrize("override,key", [("model.package=no_such_package", "model.package"),
                                          ("model.file=no_such_file.gguf", "model.file")])
def test_bad_packaged_model_names_the_key(tmp_path, override, key):
    with pytest.raises(QftError) as e:
        run.run(make_cfg(*TINY_DATA, override, tiny=False), tmp_path)
    assert e.value.key == key and "\n" not in str(e.value)
    assert record.read(tmp_path)["status"] == "failed"


def test_corrupt_model_files_get_a_clear_error(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(QftError) as e:
        run.run(make_cfg(f"model.path={gguf}", tiny=False), tmp_path / "a")
    assert e.value.key == "model.path" and "GGUF" in str(e.value)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                     "num_attention_heads": 4, "intermediate_size": 128,
                                                     "vocab_size": 49152}))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = make_cfg(f"model.path={folder}", *TINY_DATA, tiny=False)
    with pytest.raises(QftError) as e:
        run.run(cfg, tmp_path / "b")
    assert e.value.key == "model.path"


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "qft", *args, f"hydra.run.dir={cwd}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_exits_2_with_one_line(tmp_path):
    res = cli("model=tiny_llama", "adapter.attn.r=-3", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["qft: error: adapter.attn.r=-3: an integer >= 0 (0 = no adapter)"]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_cli_bad_data_path_exits_2(tmp_path):
    res = cli("model=tiny_llama", "data=local", "data.path=/no/such.csv", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("qft: error: data.path='/no/such.csv'")


def test_cli_a_budget_without_its_preset_says_which_to_choose(tmp_path):
    """budget=none (the default) has no budget keys: setting one names the presets that hold them, nothing recorded."""
    res = cli("model=tiny_llama", "budget.params=1e6", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "qft: error: budget.params: not a key of the chosen presets; it is one of +experiment=allocator_check, "
        "+experiment=budget_sweep, budget=fitted, budget=shares, budget=uniform"]
    assert not (tmp_path / "result.json").exists()


@pytest.mark.parametrize("args,needle", [
    (["model=gpt5"], "Could not find 'model/gpt5'"),
    (["adapter.attn.rnk=4"], "adapter.attn.rnk: unknown key; allowed under adapter.attn: alpha, r"),
    (["train.stpes=5"], "train.stpes: unknown key; allowed under train: batch_size, "),
    (["trian.steps=5"], "trian.steps: unknown key; allowed under the top level: accel, adapter, budget, "),
    (["model.tokenizer.revison=main"], "model.tokenizer.revison: unknown key; allowed under model.tokenizer: file, "),
    # Hydra's own settings and a group chosen by no default keep Hydra's advice, which is right for them
    (["scale=paper"], "Could not override 'scale'"),
    # a key of another preset: appending it would change nothing, so the line names the presets that have it
    (["logger.dir=/x"], "logger.dir: not a key of the chosen presets; it is one of logger=tensorboard"),
    # a name in a map whose keys are the user's: Hydra's advice to append it is right
    (["adapter.projections.v_proj={r:16}"], "use +adapter.projections.v_proj="),
    (["hydra.job.env_set.FOO=1"], "Could not override 'hydra.job.env_set.FOO'"),
])
def test_cli_hydra_errors_exit_2_with_one_line(tmp_path, args, needle):
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qft: error: ") and needle in lines[0]
    if "unknown key" in needle:
        assert "+" not in lines[0]  # not Hydra's advice to append the key, which would now be refused too


def test_value_checks_refuse_what_they_name():
    from qft import errors

    for bad in (float("nan"), float("inf"), -float("inf"), "1", True, None):
        with pytest.raises(QftError):
            errors.number("k", bad, above=0)
    errors.number("k", 10**400, above=0)  # an int is finite, however large
    errors.number("k", float("inf"), above=0, infinite=True)
    with pytest.raises(QftError):
        errors.number("k", -float("inf"), infinite=True)
    errors.text("k", "", null=True)  # unset, as None
    for bad in ("", "  ", 7, None):
        with pytest.raises(QftError):
            errors.text("k", bad)
    with pytest.raises(QftError, match="a list"):  # a string is not walked letter by letter
        errors.listing("k", "mlp", "a list")
    with pytest.raises(QftError, match="types='mlp': a list from: attn, mlp"):
        validate.validate(make_cfg("+adapter.depth_groups.x={layers:[0,1],types:mlp,r:2}"))


def test_a_refused_config_reads_nothing_and_leaves_an_ok_record(tmp_path):
    """Validation comes first: a refused config hashes no input, and where the run directory holds an ok record
    (a finished sweep rerun with a bad value, or on a machine a check refuses) that record stays."""
    ok = run.run(make_cfg(*TINY_DATA, "train.steps=1", "train.eval_every=0"), tmp_path / "ok")
    with pytest.raises(QftError):  # train.resume is outside the hash: before, this was skipped as done
        run.run(make_cfg(*TINY_DATA, "train.steps=1", "train.eval_every=0", "train.resume=1"), tmp_path / "ok")
    assert record.read(tmp_path / "ok") == ok
    with pytest.raises(QftError) as e:  # a typo in a key outside the hash is an error, not a skip
        run.run(make_cfg(*TINY_DATA, "train.steps=1", "train.eval_every=0", "+sweep.forse=true"), tmp_path / "ok")
    assert e.value.key == "sweep.forse"
    with pytest.raises(QftError):
        run.run(make_cfg(*TINY_DATA, "train.steps=1", "train.resume=1"), tmp_path / "new")
    refused = record.read(tmp_path / "new")
    assert refused["status"] == "failed" and "config_hash" not in refused and "inputs" not in refused


def test_paper_scale_validates_with_every_experiment():
    """scale=paper re-sizes any experiment (docs/studies.md), planned from a machine without its files; the studies
    with a fixed protocol keep it (before, finding1 at paper scale tested 1,000 of R8's 2,189 and read Alpaca's path)."""
    from qft import config

    sized = [f.stem for f in (Path(config.CONF) / "experiment").glob("[!_]*.yaml") if "/scale" in f.read_text()]
    assert len(sized) >= 10
    protocols = {"finding1", "finding1_pilot", "finding2", "finding2_pilot", "finding3", "allocator_check",
                 "sensitivity_gate"}
    for name in sized:  # every experiment but smoke, which checks the machinery on tiny_llama
        cfg = config.compose([f"+experiment={name}", "scale=paper"], "test")
        assert cfg is not None, name
        validate.validate(cfg, planning=True, files=False)
        cpu = config.compose([f"+experiment={name}"], "test")
        if name in protocols:  # a fixed protocol keeps its dataset and splits, and every train setting it names
            own = yaml.safe_load((Path(config.CONF) / "experiment" / f"{name}.yaml").read_text())["train"]
            assert cfg.data == cpu.data and {k: cfg.train[k] for k in own} == own, name
        else:  # a CPU-sized sweep is re-sized: Alpaca, paper splits and steps, QLoRA's warm-up
            assert (cfg.data.task, cfg.data.max_length, cfg.data.test_size) == ("instruction", 512, 1000), name
            assert (cfg.train.steps, cfg.train.warmup_steps) == (1875, 56), name
        assert cfg.model.name == "paper_7b" and cfg.train.optimizer == "paged_adamw8bit" and cfg.device == "cuda"
    assert protocols <= set(sized)


def test_every_preset_and_experiment_composes_to_declared_keys():
    """The declared keys are read from the YAML files themselves; composing each preset through Hydra checks that
    reading (packages, defaults lists) against Hydra's own."""
    from hydra import compose, initialize_config_dir

    from qft import config

    chosen = (Path(config.CONF) / "config.yaml").read_text()  # groups its defaults list names are set, others added
    choices = [f"{'' if f'- {g.name}:' in chosen else '+'}{g.name}={f.stem}" for g in Path(config.CONF).iterdir()
               if g.is_dir() and g.name not in ("hydra", "experiment") for f in g.glob("*.yaml")]
    choices += [f"+experiment={f.stem}" for f in (Path(config.CONF) / "experiment").glob("[!_]*.yaml")]
    assert len(choices) > 40
    with initialize_config_dir(config.CONF, version_base="1.3"):
        for choice in choices:
            config.check_keys(compose("config", overrides=[choice]))


@pytest.mark.parametrize("args,line", [
    (["+model.seed=5"], "model.seed=5: not a key of the chosen presets; it is one of model=tiny_llama"),
    (["+evaluate.limit=5"], "evaluate={'limit': 5}: not a key of the chosen presets; it is one of evaluate=mmlu"),
    (["quant=nf4", "+quant.mlp.threshold=2.0"], "quant.mlp.threshold=2.0: not a key of the chosen presets; it is "
                                                "one of quant=int8"),  # a 4-bit layer reads no outlier threshold
    (["model=local", "model.path=/x", "+model.arch.rope_theta=1.0"], "model.arch={'rope_theta': 1.0}: not a key of "
                                                                      "the chosen presets; it is one of model=llama2_7b"),
    (["+grid.rank=1"], "grid={'rank': 1}: not a key of the chosen presets; it is one of +experiment=_sweep"),
    (["+train.stpes=5"], "train.stpes=5: unknown key; allowed under train: batch_size, "),
])
def test_a_key_the_chosen_presets_lack_is_refused(args, line):
    """Hydra appends any key with `+`, and every preset's keys pass the check over all presets; one the chosen presets
    lack is read by nothing (a seed for a GGUF model, int8's outlier threshold on NF4, a grid outside a sweep)."""
    from hydra import compose, initialize_config_dir

    from qft import config

    with initialize_config_dir(config.CONF, version_base="1.3"):
        cfg = compose("config", overrides=args)
        if "unknown key" not in line:
            config.check_keys(cfg)
        with pytest.raises(QftError) as e:
            config.check_keys(cfg, keys=config.chosen(args))
    assert str(e.value).startswith(line)


def test_keys_the_chosen_presets_have_pass():
    from hydra import compose, initialize_config_dir

    from qft import config

    accepted = [["model=tiny_llama", "+model.arch.rope_theta=50000.0"], ["quant=int8", "++quant.mlp.threshold=2.0"],
                ["+experiment=rank_sweep", "+grid.no_preset_axis=1"], ["+adapter.projections.k_proj={r:2}"],
                ["data=reuters_r8", "+data.label_words.no_preset_label=money", "++train.steps=3"],
                ["+experiment=finding3", "quant=int8", "+quant.depth_groups.x={layers:[0],bits:8}"],
                # an 8-bit layer reads its threshold, whichever preset made it 8-bit; a later override may change it
                ["quant.attn.bits=8", "+quant.attn.threshold=1.0"],
                ["quant.attn.bits=8", "+quant.attn.threshold=1.0", "quant.attn.threshold=2.0"],
                ["model=tiny_llama", "+model.arch.rope_theta=5.0", "~model.arch.rope_theta"]]
    with initialize_config_dir(config.CONF, version_base="1.3"):
        for args in accepted:
            keys = config.chosen(args)
            assert keys is not None and ("arch" in keys["model"]) == ("model=tiny_llama" in args)  # the chosen one's
            config.check_keys(compose("config", overrides=args), keys=keys)
        assert config.chosen(["+experiment=finding1", "seed=3", "quant=int8"]) is None  # nothing appended: no reading
    assert config.chosen(["+model.seed=5"]) is None  # outside Hydra: the check over every preset stands


def test_presets_on_the_users_search_path(tmp_path):
    """A user's own presets (hydra.searchpath) are composed as Hydra composes them: their keys pass the chosen-preset
    check, and a key no preset of qft's declares stays unknown whether or not another override appends a key."""
    from hydra import compose, initialize_config_dir

    from qft import config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults: [tiny_llama, _self_]\nname: mine\n")
    (tmp_path / "model" / "typo.yaml").write_text("defaults: [tiny_llama, _self_]\nrevison: main\n")
    path = f"hydra.searchpath=[file://{tmp_path}]"
    with initialize_config_dir(config.CONF, version_base="1.3"):
        args = [path, "model=mine", "++model.seed=5"]
        config.check_keys(compose("config", overrides=args), keys=config.chosen(args))
        for extra in ([], ["++train.steps=3"]):  # the group's schema refuses it as Hydra composes
            with pytest.raises(Exception) as e:
                compose("config", overrides=[path, "model=typo", *extra])
            assert config.one_line(e.value).startswith("model.revison: unknown key; allowed under model: arch, file, ")


def test_cli_refuses_a_key_the_chosen_presets_lack(tmp_path, capsys):
    from qft import config

    res = cli("+model.seed=5", cwd=tmp_path / "run")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == ("qft: error: model.seed=5: not a key of the chosen presets; "
                                                   "it is one of model=tiny_llama")
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "failed"
    sweep = subprocess.run([sys.executable, "-m", "qft", "-m", "+logger.dir=a,b", f"hydra.sweep.dir={tmp_path / 's'}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    records = [json.loads(f.read_text()) for f in sorted((tmp_path / "s").glob("*/result.json"))]
    assert sweep.returncode == 0 and len(records) == 2, sweep.stderr[-1500:]
    assert all(r["status"] == "failed" and "logger.dir" in r["error"] for r in records)
    assert config.compose(["+logger.dir=/x"], "qft.budget") is None  # the other CLIs
    assert capsys.readouterr().err.strip() == ("qft.budget: error: logger.dir='/x': not a key of the chosen presets; "
                                               "it is one of logger=tensorboard")


def test_user_named_maps_stay_open(tmp_path):
    """Transformers config fields of a random model and dataset labels are the user's to name."""
    from qft import config

    cfg = make_cfg(*TINY_DATA, "+model.arch.rope_theta=50000.0", "data.label_words={no_preset_label:money}",
                   "+adapter.projections.k_proj={r:2}", "+quant.depth_groups.no_preset_group={layers:[0,1],bits:8}",
                   "+grid.no_preset_axis=1")
    config.check_keys(cfg)  # names no preset declares, each in a map whose keys are the user's
    assert cfg.model.arch.rope_theta == 50000.0 and cfg.data.label_words.no_preset_label == "money"
    assert model.resolve(cfg.model, cfg.cache_dir).config.rope_parameters["rope_theta"] == 50000.0  # an old name, mapped


@pytest.mark.parametrize("args,check", [
    (["model.arch.model_type=qwen2", "+model.arch.head_dim=32"], lambda c: c.head_dim == 32),  # read by name
    (["model.arch.model_type=gemma3_text", "+model.arch.sliding_window_pattern=2"],
     lambda c: c.layer_types[:2] == ["sliding_attention", "full_attention"]),
    (["+model.arch.rope_scaling={rope_type:linear,factor:2.0}"], lambda c: c.rope_parameters["factor"] == 2.0),
    (["model.arch.model_type=qwen2", "+model.arch.layer_types=[full_attention,full_attention,full_attention,"
      "full_attention]"], lambda c: c.layer_types == ["full_attention"] * 4),
])
def test_architecture_fields_the_model_reads_pass(args, check):
    """Fields a config class does not declare but its model code reads, and nested values, reach transformers."""
    cfg = make_cfg(*args)
    assert check(model.resolve(cfg.model, cfg.cache_dir).config)


def test_a_package_header_is_read_as_hydra_reads_it():
    from qft import config

    assert config._package("# @package _global_\n# more\nx: 1") == "_global_"
    assert config._package("\n# what this is\n#   @package  train.extra \nx: 1") == "train.extra"
    assert config._package("x: 1\n# @package _global_") == "_group_"  # only the leading comments count


def _rows(n=30):
    return [(f"text number {i}", "good" if i % 2 else "bad") for i in range(n)]


@pytest.mark.parametrize("name,content", [
    ("empty_cells.csv", "review,stars\n,good\n\"   \",bad\n\"fine\",\n" + "".join(f'"{t}",{s}\n' for t, s in _rows())),
    ("nulls.jsonl", '{"review": null, "stars": "good"}\n{"stars": "bad"}\n{"review": "x"}\n'
                    + "".join(f'{{"review": "{t}", "stars": "{s}"}}\n' for t, s in _rows())),
])
def test_rows_with_empty_or_missing_cells_are_left_out_and_counted(tmp_path, capfd, name, content):
    f = tmp_path / name
    f.write_text(content)
    rec = run.run(make_cfg("data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars",
                           "data.train_size=20", "data.val_size=4", "data.test_size=6", "train.steps=1"), tmp_path / "r")
    assert rec["status"] == "ok" and rec["data"]["sizes"] == {"train": 20, "val": 4, "test": 6}
    assert "left out 3 of 33 rows" in capfd.readouterr().err


@pytest.mark.parametrize("name,content,key", [
    ("only_empty.csv", "review,stars\n,a\n,b\n", "data.label_column"),   # nothing left: too few labels
    ("broken.json", '{"review": "a", "stars": ', "data.path"),          # the reader's multi-line error, one line
    ("no_column.csv", "body,stars\nhello,a\nbye,b\n", "data.text_column"),
    ("empty.csv", "", "data.path"),
])
def test_bad_data_files_exit_2_with_one_line(tmp_path, name, content, key):
    f = tmp_path / name
    f.write_text(content)
    res = cli("model=tiny_llama", "data=local", f"data.path={f}", "data.text_column=review", "data.label_column=stars",
              "train.steps=1", cwd=tmp_path / "run")
    assert res.returncode == 2, res.stderr[-1500:]
    errors = [l for l in res.stderr.strip().splitlines() if l.startswith("qft: error")]
    assert len(errors) == 1 and errors[0].startswith(f"qft: error: {key}=") and "Traceback" not in res.stderr
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("where", ["/proc/no/such/dir", "{file}/run"])
def test_an_output_folder_that_cannot_be_made_exits_2_with_one_line(tmp_path, where):
    (tmp_path / "file").write_text("a file, not a folder")
    res = subprocess.run([sys.executable, "-m", "qft", "model=tiny_llama", "train.steps=1",
                          f"hydra.run.dir={where.format(file=tmp_path / 'file')}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qft: error: hydra.run.dir=")


def test_wrapped_library_errors_stay_one_line():
    e = QftError("model.path", "/m", "weights are not loadable (OSError: first line\n  second line\n\nthird)")
    assert "\n" not in str(e) and str(e).endswith("(OSError: first line second line third)")


def test_a_second_run_on_another_thread_of_one_process_is_refused(tmp_path, monkeypatch):
    """torch's random generator and thread count are the process's: two runs on threads of one process would each
    draw the other's numbers and both record ok. While one runs, a second is refused in one line and records nothing;
    once it ends, the next goes."""
    import threading

    entered, release = threading.Event(), threading.Event()
    real = validate.validate

    def held(cfg, **kw):  # the worker's run waits inside, at its first step, until the main thread has tried
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(120)
        return real(cfg, **kw)

    monkeypatch.setattr(validate, "validate", held)
    cfg = make_cfg(*TINY_DATA, "train.steps=1", "train.eval_every=0", "train.zero_shot=false")
    done = []
    worker = threading.Thread(target=lambda: done.append(run.run(cfg, tmp_path / "first")))
    worker.start()
    assert entered.wait(120)
    with pytest.raises(QftError, match="another run is in progress in this process") as e:
        run.run(cfg, tmp_path / "second")
    assert "\n" not in str(e.value) and not (tmp_path / "second").exists()
    release.set()
    worker.join(300)
    assert done[0]["status"] == "ok"
    with pytest.raises(QftError) as e:  # the lock is free again: this one reaches validation
        run.run(make_cfg(*TINY_DATA, "train.steps=0"), tmp_path / "third")
    assert e.value.key == "train.steps"
