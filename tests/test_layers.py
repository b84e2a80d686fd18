import re
from pathlib import Path

import pytest
from torch import nn

from qft import layers, model
from qft import layers as L
from qft.errors import QftError
from conftest import make_cfg


def tiny():
    cfg = make_cfg()
    return model.load(model.resolve(cfg.model, cfg.cache_dir))


def test_every_projection_is_classified_with_type_and_depth():
    found = layers.classify(tiny(), "llama")
    assert len(found) == 4 * 7
    assert {(l.depth, l.proj) for l in found} == {(d, p) for d in range(4) for p in layers.PROJECTIONS}
    for l in found:
        assert l.layer_type == ("attn" if l.proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp")
    shapes = {l.proj: (l.in_features, l.out_features) for l in found}
    assert shapes == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                      "gate_proj": (64, 160), "up_proj": (64, 160), "down_proj": (160, 64)}


def test_unknown_architecture_lists_the_linear_modules():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.ModuleDict({"wqkv": nn.Linear(4, 12)}) for _ in range(2)])
    with pytest.raises(QftError) as e:
        layers.classify(Odd(), "oddformer")
    assert "blocks.*.wqkv" in str(e.value) and e.value.key == "model.model_type"


def test_resolution_order_type_then_projection_then_depth_groups():
    found = layers.classify(tiny(), "llama")
    spec = {"attn": {"r": 8}, "mlp": {"r": 4}, "projections": {"v_proj": {"r": 16}},
            "depth_groups": {"deep": {"layers": [2, 3], "r": 2, "types": ["attn"]},
                             "last_down": {"layers": [3, 3], "r": 1, "projections": ["down_proj"]}}}
    got = layers.resolve(spec, found, {"r": None})
    assert got["model.layers.0.self_attn.q_proj"]["r"] == 8
    assert got["model.layers.0.self_attn.v_proj"]["r"] == 16
    assert got["model.layers.2.self_attn.v_proj"]["r"] == 2
    assert got["model.layers.2.mlp.up_proj"]["r"] == 4
    assert got["model.layers.3.mlp.down_proj"]["r"] == 1
    assert got["model.layers.3.mlp.gate_proj"]["r"] == 4


def test_depth_thirds_cover_the_stack():
    assert layers.depth_thirds(30) == {"shallow": (0, 9), "middle": (10, 19), "deep": (20, 29)}
    assert layers.depth_thirds(4) == {"shallow": (0, 0), "middle": (1, 2), "deep": (3, 3)}


# a 2-layer model of each architecture docs/usage.md lists, from its transformers config
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def small(model_type, **extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **SMALL, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def readme_architectures() -> list[str]:
    text = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()  # README links there
    line = re.search(r"Architectures in the registry \(`qft/layers.py`\): ([^.]*)\.", text).group(1)
    return [a.strip() for a in line.split(",")]


def test_the_readme_lists_exactly_the_registry():
    assert sorted(readme_architectures()) == sorted(L.REGISTRY)


@pytest.mark.parametrize("model_type", sorted(L.REGISTRY))
def test_every_listed_architecture_is_classified_whole_and_counted_exactly(model_type):
    from omegaconf import OmegaConf

    from qft import adapter, schema

    net = small(model_type)
    layers = L.classify(net, model_type)
    assert len(layers) == 2 * 7 and {l.proj for l in layers} == set(L.PROJECTIONS)
    classified = {l.name for l in layers}
    for name, p in net.named_parameters():  # every weight matrix of a decoder layer is a classified projection
        if ".layers." in name and p.dim() >= 2:
            assert name.rsplit(".", 1)[0] in classified, name
    cfg = OmegaConf.create({**schema.defaults("adapter"), "attn": {"r": 4, "alpha": 8}, "mlp": {"r": 2, "alpha": 8},
                            "projections": None, "depth_groups": None, "dropout": 0.0, "dropout_mask": "torch"})
    wrapped, plan = adapter.attach(net, cfg, layers)
    counted = adapter.count(plan, layers)["total"]
    assert counted == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert counted == sum((4 if l.layer_type == "attn" else 2) * (l.in_features + l.out_features) for l in layers)


@pytest.mark.parametrize("model_type,extra,says", [
    ("phi3", {}, "fused (qkv_proj, gate_up_proj)"),
    ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1}, "mixture of experts"),
])
def test_architectures_qft_cannot_serve_fully_are_refused_by_name(model_type, extra, says):
    with pytest.raises(QftError) as e:
        L.classify(small(model_type, **extra), model_type)
    assert e.value.key == "model.model_type" and says in str(e.value) and "\n" not in str(e.value)


def test_an_unclassified_weight_matrix_is_an_error_never_silence():
    import torch

    net = small("llama")
    net.model.layers[1].mlp.extra_proj = torch.nn.Linear(32, 32)  # a projection the registry does not know
    with pytest.raises(QftError) as e:
        L.classify(net, "llama")
    assert "model.layers.*.mlp.extra_proj" in str(e.value)
