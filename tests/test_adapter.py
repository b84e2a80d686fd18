import math

import pytest

from qft import adapter
from conftest import build


def independent_count(base, ranks: dict) -> int:
    """sum r * (d_in + d_out), with the shapes read from the 4-bit weights' quantization state."""
    total = 0
    for name, r in ranks.items():
        module = base.get_submodule(name)
        d_out, d_in = getattr(module, "base_layer", module).weight.quant_state.shape
        total += r * (d_in + d_out)
    return total


OVERRIDES = ["adapter.attn.r=8", "adapter.attn.alpha=16", "adapter.mlp.r=4", "adapter.mlp.alpha=32",
             "+adapter.projections.v_proj={r:16,alpha:8}",
             "+adapter.depth_groups.deep={layers:[2,3],r:2,types:[mlp]}",
             "+adapter.depth_groups.top_q={layers:[3,3],r:0,projections:[q_proj]}"]


def expected(name: str) -> tuple[int, float]:
    depth = int(name.split(".")[2])
    proj = name.rsplit(".", 1)[1]
    if proj == "q_proj" and depth == 3:
        return 0, 16
    if proj == "v_proj":
        return 16, 8
    if proj in ("q_proj", "k_proj", "o_proj"):
        return 8, 16
    return (2 if depth >= 2 else 4), 32


@pytest.fixture(scope="module")
def mixed():
    """build(*OVERRIDES) once for the tests below, which read its modules, counts and saved config and change nothing
    (no training, no forward pass, no hook)."""
    return build(*OVERRIDES)


def test_every_module_gets_exactly_its_rank_and_alpha(mixed):
    cfg, _, built = mixed
    base = built.model.get_base_model()
    for layer in built.projections:
        r, alpha = expected(layer.name)
        module = base.get_submodule(layer.name)
        if r == 0:
            assert not hasattr(module, "lora_A"), layer.name
            continue
        assert module.lora_A["default"].weight.shape == (r, layer.in_features)
        assert module.lora_B["default"].weight.shape == (layer.out_features, r)
        assert math.isclose(module.scaling["default"], alpha / r)


def test_trainable_parameter_counts_are_exact(mixed):
    cfg, _, built = mixed
    ranks = {l.name: expected(l.name)[0] for l in built.projections}
    base = built.model.get_base_model()
    total = independent_count(base, {n: r for n, r in ranks.items()})
    trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    assert built.params["total"] == trainable == total
    attn = independent_count(base, {n: r for n, r in ranks.items() if "self_attn" in n})
    assert built.params["per_layer_type"] == {"attn": attn, "mlp": total - attn}
    assert sum(built.params["per_depth"]) == total
    # tiny_llama: q/o 64x64, k/v 64x32, mlp 64x160; by hand for layer 3 (deep, q off): k 8*96 + v 16*96 + o 8*128 + mlp 3*2*224
    assert built.params["per_depth"][3] == 8 * 96 + 16 * 96 + 8 * 128 + 3 * 2 * 224
    groups = built.params["per_depth_group"]
    assert groups["shallow"] == built.params["per_depth"][0]
    assert groups["deep"] == sum(built.params["per_depth"][2:]) and groups["top_q"] == built.params["per_depth"][3]


def test_count_from_shapes_alone_matches_built_model(mixed):
    cfg, _, built = mixed
    plan = adapter.plan(cfg.adapter, built.projections)
    counted = adapter.count(plan, built.projections)
    # the built model's own trainable tensors, by name
    trainable = {n: p.numel() for n, p in built.model.named_parameters() if p.requires_grad}
    assert counted["total"] == sum(trainable.values())
    assert counted["per_layer_type"]["attn"] == sum(v for n, v in trainable.items() if ".self_attn." in n)
    assert counted["per_layer_type"]["mlp"] == sum(v for n, v in trainable.items() if ".mlp." in n)


def test_rslora_scaling():
    cfg, _, built = build("adapter.use_rslora=true", "adapter.attn.r=4", "adapter.attn.alpha=8")
    q = built.model.get_base_model().get_submodule("model.layers.0.self_attn.q_proj")
    assert math.isclose(q.scaling["default"], 8 / math.sqrt(4))


def test_rank_zero_type_gets_no_adapter():
    cfg, _, built = build("adapter=mlp_only")
    assert built.params["per_layer_type"]["attn"] == 0
    assert built.params["per_layer_type"]["mlp"] > 0
    assert not hasattr(built.model.get_base_model().get_submodule("model.layers.0.self_attn.q_proj"), "lora_A")


def test_saved_adapter_config_is_stock_peft(mixed, tmp_path):
    cfg, _, built = mixed
    built.model.save_pretrained(tmp_path)
    from peft import PeftConfig

    conf = PeftConfig.from_pretrained(tmp_path)
    assert conf.peft_type == "LORA" and (tmp_path / "adapter_model.safetensors").exists()
    # every module's rank and alpha, as stock peft resolves them from the saved r / rank_pattern / alpha_pattern
    import re

    def resolve(pattern: dict, default, name):
        hits = [v for k, v in pattern.items() if re.fullmatch(rf"(.*\.)?{k}", name)]
        return hits[0] if hits else default
    targets = [l.name for l in built.projections if expected(l.name)[0] > 0]
    assert all(bool(re.fullmatch(conf.target_modules, l.name)) == (l.name in targets) for l in built.projections)
    for name in targets:
        assert (resolve(conf.rank_pattern, conf.r, name), resolve(conf.alpha_pattern, conf.lora_alpha, name)) \
            == expected(name), name


# two depth groups that overlap on layers 2-3's MLP: README's rule is the order written, later wins
OVERLAP = {"wide": "{layers:[1,3],r:2,alpha:4,types:[mlp]}", "narrow": "{layers:[2,3],r:6,alpha:12,types:[mlp]}"}


@pytest.mark.parametrize("order", [("wide", "narrow"), ("narrow", "wide")])
def test_overlapping_depth_groups_later_wins_for_rank_and_alpha(order):
    from qft import layers, model
    from conftest import make_cfg

    cfg = make_cfg("adapter.mlp.r=4", "adapter.mlp.alpha=8", *(f"+adapter.depth_groups.{g}={OVERLAP[g]}" for g in order))
    assert list(cfg.adapter.depth_groups) == list(order)
    found = layers.classify(model.load(model.resolve(cfg.model, cfg.cache_dir)), "llama")
    got = adapter.plan(cfg.adapter, found)
    last = {"wide": (2, 4), "narrow": (6, 12)}[order[-1]]
    for layer in found:
        if layer.layer_type != "mlp":
            continue
        want = (4, 8) if layer.depth == 0 else (2, 4) if layer.depth == 1 else last
        assert (got[layer.name]["r"], got[layer.name]["alpha"]) == want, layer.name
