"""A quantization backend is one file: the toy 4-bit round-to-nearest of tests/rtn4_backend.py, registered by loading
that file alone, builds, trains through peft's own LoRA layer, is counted by the memory model, and rebuilds from the
quantized-base cache."""

import runpy
from pathlib import Path

import pytest
import torch
from peft.tuners import lora

from qft import quant, train, validate
from qft.planning import footprint
from qft.errors import QftError
from conftest import build, make_cfg

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
ANSWERS = [[100], [200, 201, 202]]


@pytest.fixture
def rtn4():
    ns = runpy.run_path(str(Path(__file__).with_name("rtn4_backend.py")))
    yield ns
    quant.BACKENDS.pop("rtn4")


def test_a_quant_type_no_backend_serves_is_refused_with_the_allowed_ones():
    with pytest.raises(QftError, match=r"quant.mlp.quant_type.*nf4, fp4"):
        validate.validate(make_cfg("quant.mlp.quant_type=rtn4"))


def test_a_backend_from_one_file_trains_and_is_counted(rtn4, tmp_path, monkeypatch):
    where = quant.cache_file
    monkeypatch.setattr(quant, "cache_file",
                        lambda cfg, layers, fp, dev, _, *deq: where(cfg, layers, fp, dev, tmp_path, *deq))
    over = ("quant.mlp.quant_type=rtn4", "quant.compute_dtype=fp32", "adapter.dropout=0.0")
    validate.validate(make_cfg(*over))  # allowed once the file is loaded
    cfg, _, built = build(*over)
    base = built.model.get_base_model()
    plan = footprint.resolve(cfg)
    closed = 0
    for layer in built.projections:
        m = base.get_submodule(layer.name)
        want = "rtn4" if layer.layer_type == "mlp" else "nf4"
        assert type(m) is (lora.Linear if want == "rtn4" else lora.bnb.Linear4bit)  # peft's own LoRA layers
        assert quant.describe(m.base_layer) == footprint.format_of(plan.quant[layer.name], "fp32") == want
        assert footprint.projection_bytes(layer.in_features, layer.out_features, plan.quant[layer.name], 4) \
            == quant.module_bytes(m.base_layer)
        if want == "rtn4":  # packed codes, two a byte, and an fp32 scale per 32 weights
            closed += layer.in_features * layer.out_features // 2 + layer.out_features * layer.in_features // 32 * 4
    assert built.base_bytes["mlp"] == closed
    costs = footprint.layer_costs(cfg, resolved=plan)
    assert sum(c.detail.get("frozen.mlp", 0) for c in costs) == closed

    # the gradients of one toy projection against plain float math on its dequantized weight
    name = next(l.name for l in built.projections if l.proj == "down_proj")
    m = base.get_submodule(name)
    with torch.no_grad():
        m.lora_B["default"].weight.normal_()
    w = quant.dequantized_weight(m.base_layer)
    a, b, s = m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"]
    x = torch.randn(2, 3, m.in_features, requires_grad=True)
    (m(x) ** 2).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    ((xr @ w.t() + s * (xr @ a.t()) @ b.t()) ** 2).sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-5, atol=1e-5 * xr.grad.abs().max().item())
    assert a.grad.abs().sum() > 0

    # a training step through the whole model moves the toy projections' adapters
    built.model.zero_grad()
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = train.make_optimizer(cfg.train, params)
    before = {n: p.detach().clone() for n, p in built.model.named_parameters() if "mlp" in n and "lora_B" in n}  # A waits for B
    loss, n, _ = train.answer_loss(built.model, PROMPTS, ANSWERS, 2, torch.float32)
    (loss / n).backward()
    opt.step()
    moved = [k for k, p in built.model.named_parameters() if k in before and not torch.equal(p, before[k])]
    assert torch.isfinite(loss) and len(moved) == len(before)

    # a second build rebuilds the toy modules from the cache the first one filled, tensor for tensor
    for b_ in quant.BACKENDS.values():
        monkeypatch.setattr(b_, "quantize", lambda *a, **k: pytest.fail("quantized again despite the cache"))
    _, _, again = build(*over)
    for layer in built.projections:
        one = base.get_submodule(layer.name).base_layer
        two = again.model.get_base_model().get_submodule(layer.name).base_layer
        assert type(one) is type(two) and torch.equal(quant.dequantized_weight(one), quant.dequantized_weight(two))


def test_a_file_in_the_package_is_a_backend_without_any_other_change(tmp_path, monkeypatch):
    """qft.quant imports every module of its package: a backend file put beside bnb4.py registers itself."""
    import shutil
    import sys

    shutil.copy(Path(__file__).with_name("rtn4_backend.py"), tmp_path / "rtn4_extra.py")
    monkeypatch.setattr(quant, "__path__", [*quant.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "qft.quant.rtn4_extra", raising=False)
    try:
        quant.discover()
        assert "rtn4" in quant.BACKENDS and "rtn4" in quant.quant_types()
    finally:
        quant.BACKENDS.pop("rtn4", None)
        sys.modules.pop("qft.quant.rtn4_extra", None)
