"""qft.accel: the speed switches as the schema resolves them (accel.*), and one entry point that installs what
applies and says what ran."""

import pytest
import torch
from conftest import build, make_cfg

from qft import accel, record, schema


def test_switches_are_the_schemas_eight_on_the_cpu():
    cfg = make_cfg("accel.compiled_rope=false", "accel.cache_dequantized=true", "accel.host_allocator=default")
    on = accel.switches(cfg, "cpu")
    assert on == schema.accel_switches(cfg, "cpu") and len(on) == 8
    assert on["compiled_rope"] is False and on["cache_dequantized"] is True and on["host_allocator"] == "default"
    assert on["fuse_projections"] is True  # accel=auto on a CPU: the mode's value
    assert accel.switches(make_cfg("accel=off", "accel.compiled_rope=true"), "cpu")["compiled_rope"] is True
    assert accel.switches(make_cfg("accel=off"), torch.device("cpu")) == {
        **dict.fromkeys(on, False), "host_allocator": "default"}


def test_switches_off_the_cpu_keep_only_those_that_are_not_cpu_code():
    """accel=cpu asked on CUDA: the schema resolves every switch on, the speed layer applies the cache and the
    allocator and none of the CPU-only ones (which are the model switches)."""
    cfg = make_cfg("accel=cpu", "accel.fuse_projections=true")
    assert schema.accel_switches(cfg, "cuda")["fuse_projections"] is True
    for device in ("cuda", "cuda:1", torch.device("meta")):
        on = accel.switches(cfg, device)
        assert on == {**dict.fromkeys(accel.MODEL_SWITCHES, False), "host_allocator": "tuned",
                      "cache_quantized": True, "cache_dequantized": False}


def test_install_decides_the_switches_the_record_names():
    assert accel.MODEL_SWITCHES == schema.cpu_only("accel")
    assert set(accel.MODEL_SWITCHES) == {"fuse_projections", *record.SWITCHES}
    assert set(accel.MODEL_SWITCHES) < set(accel.switches(make_cfg(), "cpu"))


def test_tune_host_allocator_takes_the_resolved_name():
    assert accel.tune_host_allocator("default") is False  # glibc left as it is


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_install_off_the_cpu_installs_nothing(device):
    """The compiled loops and fusion are CPU code: for training elsewhere nothing is installed, and the answer says
    so switch by switch."""
    cfg, source, built = build("accel.fuse_projections=false", "accel.compiled_masks=false",
                               "accel.compiled_rope=false", "adapter.dropout_mask=fast")
    on = make_cfg(*(f"accel.{k}=true" for k in accel.MODEL_SWITCHES), "adapter.dropout_mask=fast")
    ran = accel.install(built.model, on, torch.device(device), built.projections, source.model_type, threads=2)
    assert ran == dict.fromkeys(accel.MODEL_SWITCHES, False)
    assert not getattr(built.model, "_qft_fused", []) and not any(
        getattr(m, "compiled", False) for m in built.model.modules())


def test_install_on_the_cpu_says_what_it_installed():
    cfg, source, built = build("accel.fuse_projections=false", "accel.compiled_masks=false",
                               "accel.compiled_rope=false", "adapter.dropout_mask=fast", "adapter.dropout=0.1")
    assert not any(built.ran.values())
    on = make_cfg(*(f"accel.{k}=true" for k in accel.MODEL_SWITCHES), "adapter.dropout_mask=fast")
    ran = accel.install(built.model, on, torch.device("cpu"), built.projections, source.model_type, threads=1)
    # one thread: the row halves never split, so that switch is not installed
    assert ran == {**dict.fromkeys(accel.MODEL_SWITCHES, True), "split_rows": False}
    assert len(built.model._qft_fused) == 4 * 4 and all(g.compiled and not g.split_rows
                                                        for g in built.model._qft_fused)


def test_switches_apply_on_the_cpu_only():
    cfg = make_cfg(*(f"accel.{k}=true" for k in accel.MODEL_SWITCHES))
    assert accel.on_device(cfg, "cpu") == dict.fromkeys(accel.MODEL_SWITCHES, True)
    assert accel.on_device(cfg, "cuda") == dict.fromkeys(accel.MODEL_SWITCHES, False)
    assert accel.on_device(make_cfg("accel.compiled_rope=false"), "cpu")["compiled_rope"] is False
    assert accel.on_device(make_cfg("accel=off"), "cpu") == dict.fromkeys(accel.MODEL_SWITCHES, False)


def test_the_memory_model_plans_fusion_where_it_runs():
    """Fusion runs on the CPU only (accel.install): a GPU plan with accel.fuse_projections=true is the unfused one,
    a CPU plan is not (the head's cast is then held once, not per micro-batch)."""
    from qft.tools import memory

    def plan(device, fused):
        return memory.estimate(make_cfg("quant.compute_dtype=bf16", f"device={device}",
                                        f"accel.fuse_projections={fused}")).components

    assert plan("cuda", "true") == plan("cuda", "false")
    assert plan("cpu", "true") != plan("cpu", "false")
