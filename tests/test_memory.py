"""The memory model: exact weight, adapter and optimizer bytes against the built model, the estimated peak of
a real training step against its measurement, and the CLI (meta-device presets, budgets, bad input)."""

import pytest
import torch
from conftest import build, make_cfg
from omegaconf import open_dict

from qft import quant
from qft.planning import footprint, measure, stages
from qft.tools import memory
from qft.errors import QftError

B, S, K = 8, 32, 2  # a synthetic batch: every answer K tokens, widths S - 2 .. S (left padding)


def batch(b=B, s=S, k=K):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 1000, (s - k - i % 3,), generator=g).tolist() for i in range(b)], [[5] * k] * b


def sized(cfg, b=B, s=S):
    with open_dict(cfg):
        cfg.train.batch_size, cfg.data.max_length = b, s
    return cfg


@pytest.mark.parametrize("overrides", [
    [], ["quant.attn.double_quant=false", "quant.mlp.double_quant=false"], ["quant=fp4"], ["quant=int8"],
    ["quant=none", "quant.compute_dtype=bf16"], ["quant=attn8_mlp4", "quant.mlp.block_size=128"],
    ["+quant.depth_groups.first={layers:[0,1],bits:8}", "+quant.projections.down_proj={bits:16}",
     "quant.attn.block_size=4096"],
    ["model.arch.model_type=qwen2", "quant=attn8_mlp4"],  # biased q, k, v
    ["model.arch.model_type=qwen2", "quant=none", "quant.compute_dtype=bf16"],
])
def test_weight_bytes_equal_the_quantized_model(overrides):
    cfg, source, built = build(*overrides)
    plan = footprint.resolve(cfg)
    costs = footprint.layer_costs(cfg, resolved=plan)
    base = built.model.get_base_model()
    for layer in built.projections:  # module by module, statistics included
        module = base.get_submodule(layer.name)
        module = getattr(module, "base_layer", module)
        assert footprint.projection_bytes(layer.in_features, layer.out_features, plan.quant[layer.name],
                                       plan.compute_bytes, layer.name in plan.biased) == quant.module_bytes(module)
    got = {lt: sum(c.detail.get(f"frozen.{lt}", 0) for c in costs) for lt in ("attn", "mlp")}
    got["other"] = sum(c.detail["frozen.other"] for c in costs)  # embedding (tied: once), norms, rotary
    assert got == {k: built.base_bytes[k] for k in ("attn", "mlp", "other")}


def test_adapter_gradient_and_optimizer_bytes_are_exact():
    cfg, _, built = build("adapter.attn.r=4", "adapter.mlp.r=2", "+adapter.projections.v_proj={r:8,alpha:8}",
                          "+adapter.depth_groups.last={layers:[3,3],r:0}")
    costs = footprint.layer_costs(cfg)
    trainable = [p for p in built.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    assert sum(c.detail.get("params", 0) for c in costs) == n == built.params["total"]
    assert sum(c.detail.get("adapter", 0) for c in costs) == 4 * n
    assert sum(c.detail.get("grads", 0) for c in costs) == 4 * n
    opt = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()  # allocates the states: two fp32 moments a parameter and a step counter a tensor
    assert sum(c.detail.get("optimizer", 0) for c in costs) == measure.tensor_bytes(opt)
    assert footprint.optimizer_bytes([100, 5000], "adamw8bit", "cuda") == 8 * 100 + 2 * 5000 + 2 * 4 * 20 + 2048


def test_measure_peak_counts_what_is_held():
    def fn():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        del a
        c = torch.empty(3 << 20, dtype=torch.uint8)
        del b, c
    assert measure.measure_peak(fn) == 5 << 20


@pytest.mark.parametrize("overrides", [
    ["quant.compute_dtype=bf16"], ["quant.compute_dtype=fp32"],
    ["quant=int8", "quant.compute_dtype=bf16", "train.gradient_checkpointing=true"],
    ["quant=attn8_mlp4", "quant.compute_dtype=fp32", "adapter.dropout=0"],
])
def test_estimated_step_peak_is_near_the_measured_one(overrides):
    cfg, _, built = build(*overrides)
    cfg = sized(cfg)
    est = memory.estimate(cfg, answer_tokens=K)
    dtype = torch.bfloat16 if cfg.quant.compute_dtype == "bf16" else torch.float32
    measured = measure.measure_step(built.model, cfg.train, [batch()], 2, dtype)
    assert abs(est.peak / measured["peak"] - 1) < 0.15, (est.components, measured)
    assert sum(est.components.values()) == est.peak


def test_checkpointing_and_offload_lower_the_activations():
    cfg = sized(make_cfg("quant.compute_dtype=bf16", "device=cuda"), b=16, s=256)  # planned for a GPU

    def act(c):
        return sum(v for k, v in memory.estimate(c).components.items() if k.startswith("activations"))

    plain = act(cfg)
    assert act(memory._with(cfg, {"train.gradient_checkpointing": True})) < plain / 4
    assert act(memory._with(cfg, {"offload.mode": "activations"})) < plain / 3
    off = memory.estimate(memory._with(cfg, {"offload.mode": "activations"}))
    assert off.host_bytes > 0 and off.peak < memory.estimate(cfg).peak and sum(off.components.values()) == off.peak
    on_cpu = memory.estimate(memory._with(cfg, {"offload.mode": "activations", "device": "cpu"}))
    assert on_cpu.peak > memory.estimate(memory._with(cfg, {"device": "cpu"})).peak  # host memory is the same there
    small = memory.estimate(memory._with(cfg, {"train.batch_size": 4, "train.grad_accum": 4}))
    assert small.peak < memory.estimate(cfg).peak


def test_1f1b_stage_peaks_fall_with_stage_index_and_gpipe_holds_every_micro_batch():
    cfg = sized(make_cfg("model.arch.num_hidden_layers=8", "offload=pipeline", "offload.stages=4", "device=cuda"),
                b=16, s=64)
    plan = footprint.resolve(cfg)
    mb = footprint.layer_costs(cfg, 4, resolved=plan)  # micro-batch = 16 / 4
    per_stage_act = mb[3].act + mb[4].act + mb[0].act  # layers 2 and 3 (as every layer after the first), rotary
    one = stages.stage_peaks(cfg, [2, 4, 6], "1f1b", 4, resolved=plan)
    assert one[0] > one[1] > one[2]
    assert one[1] - one[2] == per_stage_act  # 3 micro-batches in flight against 2
    gpipe = stages.stage_peaks(cfg, [2, 4, 6], "gpipe", 4, resolved=plan)
    assert gpipe[1] == gpipe[2] == one[1] + per_stage_act  # all 4
    host = []
    off = stages.stage_peaks(cfg, [2, 4, 6], "1f1b", 4, offload_stages=(0,), resolved=plan, host=host)
    assert off[0] < one[0] and off[1:] == one[1:] and host[0] == 4 * (mb[1].act + mb[2].act) and host[1:] == [0, 0, 0]
    with pytest.raises(QftError) as e:
        stages.stage_peaks(cfg, [2, 4, 6], "1f1b", 3, resolved=plan)
    assert e.value.key == "offload.micro_batches"
    est = memory.estimate(cfg)  # the planner's split, broken down on the most loaded stage
    assert len(est.stage_peaks) == 4 and sum(est.components.values()) == est.peak
    assert est.stage_peaks == stages.stage_peaks(cfg, est.boundaries, offload_stages=est.offloaded)


@pytest.mark.parametrize("override, key", [("quant.attn.bits=5", "quant.attn.bits"),
                                           ("offload.mode=disk", "offload.mode"),
                                           ("train.batch_size=0", "train.batch_size")])
def test_bad_keys_raise_qft_error(override, key):
    with pytest.raises(QftError) as e:
        memory.estimate(make_cfg(override))
    assert e.value.key == key


def test_cli_plans_a_7b_model_on_the_meta_device(capsys):
    assert memory.main(["model=llama2_7b", "train.batch_size=4", "data.max_length=512", "device=cuda"]) == 0
    out = capsys.readouterr().out
    assert "llama2_7b on cuda (bf16 compute), batch 4 x seq 512" in out and "| frozen mlp nf4 | 2.080 |" in out
    assert memory.main(["model=llama2_7b", "train.batch_size=4", "data.max_length=512", "device=cuda",
                        "offload.device_budget_gb=16"]) == 0
    out = capsys.readouterr().out
    assert "budget 16 GiB per device: training does not fit" in out
    assert "| train.gradient_checkpointing=true |" in out and "| yes |" in out


@pytest.mark.parametrize("args, needle", [(["model=llama2_7b", "adapter.mlp.r=-1"], "adapter.mlp.r=-1"),
                                          (["model=llama2_7b", "nosuch.key=1"], "nosuch.key")])
def test_cli_bad_input_exits_2_with_one_line(args, needle, capsys):
    assert memory.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qft.tools.memory: error: ") and needle in err[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_shared_dropout_saves_what_the_memory_model_says(dtype):
    """One mask (and, in fp32, one dropped input) a group instead of one a projection: the estimate moves by what
    the measured step moves, byte for byte."""
    est, got = {}, {}
    for shared in ("false", "true"):
        cfg, _, built = build(f"quant.compute_dtype={dtype}", f"adapter.shared_dropout={shared}")
        cfg = sized(cfg)
        est[shared] = memory.estimate(cfg, answer_tokens=K).peak
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        got[shared] = measure.measure_step(built.model, cfg.train, [batch()], 2, torch_dtype)["peak"]
    assert est["true"] < est["false"]
    assert est["true"] - est["false"] == got["true"] - got["false"]


def test_fp32_attention_costs_what_the_memory_model_says():
    """quant.attention_dtype=fp32 under bf16 autocast: SDPA keeps q, k, v, its output and its mask in fp32, not bf16;
    the estimate moves by what the measured step moves, byte for byte."""
    est, got = {}, {}
    for attention in ("compute", "fp32"):
        cfg, _, built = build("quant.compute_dtype=bf16", f"quant.attention_dtype={attention}")
        cfg = sized(cfg)
        est[attention] = memory.estimate(cfg, answer_tokens=K).peak
        got[attention] = measure.measure_step(built.model, cfg.train, [batch()], 2, torch.bfloat16)["peak"]
    assert est["fp32"] > est["compute"]
    assert est["fp32"] - est["compute"] == got["fp32"] - got["compute"]
