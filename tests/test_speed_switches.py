"""Every speed switch is a config key, and none changes the numbers: same loss, gradients and scores."""

import pytest
import torch

from qft import quant, train
from conftest import build

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
ANSWERS = [[100], [200, 201, 202], [300, 301]]


def loss_grads_logits(*overrides):
    _, _, built = build("adapter.dropout=0.0", *overrides)
    net = built.model
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(hash(n) % 2**31))
    loss, n, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, torch.bfloat16)
    (loss / n).backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = net(input_ids=torch.tensor([PROMPTS[2]])).logits.float()
    return built, loss.item(), grads, logits


@pytest.mark.parametrize("preset", ["nf4", "fp4", "attn8_mlp4"])
def test_cache_dequantized_changes_no_numbers(preset):
    ref_built, ref_loss, ref_grads, ref_logits = loss_grads_logits(f"quant={preset}")
    built, loss, grads, logits = loss_grads_logits(f"quant={preset}", "quant.cache_dequantized=true")
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert torch.equal(grads[k], ref_grads[k]), k
    assert torch.equal(logits, ref_logits)
    # the 4-bit projections are now plain bf16 linears; the record still describes the 4-bit base
    base = built.model.get_base_model()
    kinds = {type(base.get_submodule(l.name).base_layer).__name__ for l in built.projections if l.layer_type == "mlp"}
    assert kinds == {"Dequantized"}
    assert built.base_bytes == ref_built.base_bytes
    for layer in built.projections:
        a = base.get_submodule(layer.name).base_layer
        b = ref_built.model.get_base_model().get_submodule(layer.name).base_layer
        assert quant.describe(a) == quant.describe(b)


@pytest.mark.parametrize("preset,extra", [("nf4", []), ("fp4", []), ("attn8_mlp4", []), ("none", []),
                                          ("nf4", ["quant.cache_dequantized=true"])])
def test_quantized_base_cache_rebuilds_the_same_model(preset, extra, tmp_path, monkeypatch):
    where = quant.cache_file
    monkeypatch.setattr(quant, "cache_file", lambda cfg, layers, fp, dev, _: where(cfg, layers, fp, dev, tmp_path))
    over = [f"quant={preset}", *extra]
    _, ref_loss, ref_grads, ref_logits = loss_grads_logits(*over, "quant.cache_quantized=false")
    assert not list(tmp_path.glob("quantized/*"))
    first = loss_grads_logits(*over)  # quantizes and fills the cache: the tensors, and the RNG state after
    rng = list(tmp_path.glob("quantized/*.rng-*.safetensors"))
    assert len(list(tmp_path.glob("quantized/*.safetensors"))) == 2 and len(rng) == 1
    monkeypatch.setattr(quant, "_quantized", lambda *a, **k: pytest.fail("quantized again despite the cache"))
    rng[0].unlink()  # without the RNG state, the modules are built drawing the RNG as quantizing did
    second = loss_grads_logits(*over)
    assert rng[0].exists()
    rebuilt, draws = quant._rebuilt, []
    monkeypatch.setattr(quant, "_rebuilt", lambda *a, draw: draws.append(draw) or rebuilt(*a, draw=draw))
    built, loss, grads, logits = loss_grads_logits(*over)  # built on meta, the RNG state restored
    assert draws and not any(draws)
    for got in (first[1:], second[1:], (loss, grads, logits)):
        assert got[0] == ref_loss and torch.equal(got[2], ref_logits)
        assert all(torch.equal(got[1][k], ref_grads[k]) for k in ref_grads)
    assert built.base_bytes == first[0].base_bytes
