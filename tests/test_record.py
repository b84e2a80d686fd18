"""What enters the config hash: everything that changes a result, nothing that does not."""
import json

import pytest

from qft import data, record
from conftest import make_cfg


def h(*overrides):
    return record.config_hash(make_cfg(*overrides))


def test_depth_group_order_is_part_of_the_hash():
    a = ("+adapter.depth_groups.x={layers:[0,1],r:2}", "+adapter.depth_groups.y={layers:[1,2],r:4}")
    b = tuple(reversed(a))
    assert list(make_cfg(*a).adapter.depth_groups) != list(make_cfg(*b).adapter.depth_groups)
    assert h(*a) != h(*b)
    qa = ("+quant.depth_groups.x={layers:[0,1],bits:8}", "+quant.depth_groups.y={layers:[1,2],bits:16}")
    assert h(*qa) != h(*reversed(qa))


@pytest.mark.parametrize("override", ["train.eval_every=7", "train.checkpoint_every=3", "train.eval_batch_size=5",
                                      "train.zero_shot=false", "train.resume=auto",
                                      "train.stop_after_steps=2", "accel.host_allocator=default",
                                      "accel.cache_dequantized=true", "accel.cache_quantized=false",
                                      "sweep.force=true", "logger=tensorboard", "cache_dir=/elsewhere"])
def test_keys_that_change_how_not_what_stay_out(override):
    cfg = make_cfg(override)
    assert record.config_hash(cfg, inputs_={}) == record.config_hash(make_cfg(), inputs_={})


@pytest.mark.parametrize("override", ["seed=1", "train.steps=7", "adapter.attn.r=2", "quant.attn.bits=8",
                                      "data.split_seed=3", "data.stratify=proportional", "train.lr=0.01"])
def test_keys_that_change_a_result_enter(override):
    assert h(override) != h()


def test_the_experiment_name_stays_out():
    conf = record.resolved(make_cfg())
    assert record.config_hash({**conf, "experiment": "rank_sweep"}) == record.config_hash({**conf, "experiment": None})


def test_integral_floats_hash_as_integers():
    assert h("adapter.attn.alpha=16.0") == h("adapter.attn.alpha=16")


def test_the_data_format_version_enters():
    cfg = make_cfg()
    assert record.inputs(cfg)["data_format"] == data.FORMAT
    assert record.config_hash(cfg) != record.config_hash(cfg, inputs_={**record.inputs(cfg), "data_format": 1})


def test_local_data_and_model_files_enter_by_content(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("text,label\na,x\nb,y\n")
    over = ("data=local", f"data.path={f}")
    before = h(*over)
    f.write_text("text,label\na,y\nb,x\n")  # same path and size: new content
    assert h(*over) != before
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"1234")
    before = h(f"model.path={folder}")
    (folder / "model.safetensors").write_bytes(b"4321")
    assert h(f"model.path={folder}") != before


def test_fitted_budget_records_enter_by_content(tmp_path):
    run = tmp_path / "a"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"status": "ok", "final_accuracy": {"test": 0.5}}))
    over = ("budget=shares", "budget.params=20000", "budget.method=fitted", f"budget.records={tmp_path}")
    before = h(*over)
    (run / "result.json").write_text(json.dumps({"status": "ok", "final_accuracy": {"test": 0.6}}))
    assert h(*over) != before
    # the records are read only by the fitted method
    assert record.inputs(make_cfg("budget=shares", "budget.params=20000", f"budget.records={tmp_path}")
                         ).get("budget_records") is None


def test_records_from_a_gpu_are_their_own_run_kind(tmp_path):
    """A GPU's records never pair with a CPU's, nor with another GPU's: the kind names the GPU in the CPU's place."""
    from qft import frame

    cpu = {"cpu": "AMD EPYC 9R45", "cpu_id": "26/2/1", "cpu_kind": "avx512_bf16", "threads": 2, "compute_dtype": "bf16",
           "fuse_projections": True, "torch": "2.13.0+cpu", "cuda": None}
    h100 = {**cpu, "cuda": "NVIDIA H100 80GB HBM3", "fuse_projections": False, "torch": "2.11.0+cu130"}
    h200 = {**h100, "cuda": "NVIDIA H200"}
    kinds = [frame.run_kind(e) for e in (cpu, h100, h200)]
    assert kinds[1] == "NVIDIA H100 80GB HBM3, 2 threads, bf16, unfused, torch 2.11.0+cu130"
    assert len(set(kinds)) == 3 and "EPYC" in kinds[0] and "EPYC" not in kinds[1]
    for i, e in enumerate((cpu, h100)):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(json.dumps(
            {"status": "ok", "config": {"train": {"eval_batch_size": 32}}, "seed": 0, "execution": e,
             "final_accuracy": {"test": 0.5}}))
    df = frame.collect([tmp_path])
    assert sorted(df.run_kind) == sorted(f"{k}, eval batch 32" for k in kinds[:2])
