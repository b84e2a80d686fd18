import pytest
from torch import nn

from qft import layers, model
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
