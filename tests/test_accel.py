"""qft.accel: the speed switches read in one place, and one entry point that installs what applies and says what
ran."""

import pytest
import torch
from conftest import build, make_cfg

from qft import accel, record


def test_switches_reads_the_eight_keys_as_the_config_sets_them():
    on = accel.switches(make_cfg("train.compiled_rope=false", "quant.cache_dequantized=true",
                                 "train.host_allocator=default"))
    assert set(on) == set(accel.NAMES) and len(accel.NAMES) == 8
    assert on["compiled_rope"] is False and on["cache_dequantized"] is True and on["host_allocator"] == "default"
    assert accel.switches(make_cfg("train.compiled_rope=true"))["compiled_rope"] is True


def test_install_decides_the_switches_the_record_names():
    assert set(accel.MODEL_SWITCHES) == {"fuse_projections", *record.SWITCHES}
    assert set(accel.MODEL_SWITCHES) < set(accel.NAMES)


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_install_off_the_cpu_installs_nothing(device):
    """The compiled loops and fusion are CPU code: for training elsewhere nothing is installed, and the answer says
    so switch by switch."""
    cfg, source, built = build("train.fuse_projections=false", "train.compiled_masks=false",
                               "train.compiled_rope=false", "adapter.dropout_mask=fast")
    on = make_cfg(*(f"train.{k}=true" for k in accel.MODEL_SWITCHES), "adapter.dropout_mask=fast")
    ran = accel.install(built.model, on, torch.device(device), built.projections, source.model_type, threads=2)
    assert ran == dict.fromkeys(accel.MODEL_SWITCHES, False)
    assert not getattr(built.model, "_qft_fused", []) and not any(
        getattr(m, "compiled", False) for m in built.model.modules())


def test_install_on_the_cpu_says_what_it_installed():
    cfg, source, built = build("train.fuse_projections=false", "train.compiled_masks=false",
                               "train.compiled_rope=false", "adapter.dropout_mask=fast", "adapter.dropout=0.1")
    assert not any(built.ran.values())
    on = make_cfg(*(f"train.{k}=true" for k in accel.MODEL_SWITCHES), "adapter.dropout_mask=fast")
    ran = accel.install(built.model, on, torch.device("cpu"), built.projections, source.model_type, threads=1)
    # one thread: the row halves never split, so that switch is not installed
    assert ran == {**dict.fromkeys(accel.MODEL_SWITCHES, True), "split_rows": False}
    assert len(built.model._qft_fused) == 4 * 4 and all(g.compiled and not g.split_rows
                                                        for g in built.model._qft_fused)


def test_switches_apply_on_the_cpu_only():
    cfg = make_cfg(*(f"train.{k}=true" for k in accel.MODEL_SWITCHES))
    assert accel.on_device(cfg, "cpu") == dict.fromkeys(accel.MODEL_SWITCHES, True)
    assert accel.on_device(cfg, "cuda") == dict.fromkeys(accel.MODEL_SWITCHES, False)
    assert accel.on_device(make_cfg("train.compiled_rope=false"), "cpu")["compiled_rope"] is False


def test_the_memory_model_plans_fusion_where_it_runs():
    """Fusion runs on the CPU only (accel.install): a GPU plan with train.fuse_projections=true is the unfused one,
    a CPU plan is not (the head's cast is then held once, not per micro-batch)."""
    from qft.tools import memory

    def plan(device, fused):
        return memory.estimate(make_cfg("quant.compute_dtype=bf16", f"device={device}",
                                        f"train.fuse_projections={fused}")).components

    assert plan("cuda", "true") == plan("cuda", "false")
    assert plan("cpu", "true") != plan("cpu", "false")
