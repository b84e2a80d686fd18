import bitsandbytes as bnb
import pytest
import torch

from qft import quant
from conftest import build


def base_layer(built, name):
    return built.model.get_base_model().get_submodule(name).base_layer


def test_mixed_bits_per_module():
    _, _, built = build("quant=attn8_mlp4", "quant.compute_dtype=bf16", "+quant.projections.down_proj={bits:16}",
                        "+quant.depth_groups.first={layers:[0,0],bits:4,quant_type:fp4,types:[attn]}")
    for layer in built.projections:
        got = quant.describe(base_layer(built, layer.name))
        if layer.proj == "down_proj":
            want = "bfloat16"
        elif layer.layer_type == "attn":
            want = "fp4" if layer.depth == 0 else "int8"
        else:
            want = "nf4"
        assert got == want, layer.name


def test_embeddings_norms_and_head_stay_fp32():
    _, _, built = build()
    base = built.model.get_base_model()
    assert base.model.embed_tokens.weight.dtype == torch.float32
    assert base.model.norm.weight.dtype == torch.float32
    assert base.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("double_quant", [True, False])
def test_base_bytes_are_measured_from_the_tensors(double_quant):
    _, _, built = build(f"quant.attn.double_quant={str(double_quant).lower()}", "quant.mlp.bits=8")
    q = base_layer(built, "model.layers.0.self_attn.q_proj")
    n = 64 * 64
    qs = q.weight.quant_state
    stats = qs.absmax.numel() * qs.absmax.element_size() + qs.code.numel() * 4
    if double_quant:
        assert qs.absmax.dtype == torch.uint8
        stats += qs.state2.absmax.numel() * 4 + qs.state2.code.numel() * 4 + qs.offset.numel() * 4
    else:
        assert qs.absmax.dtype == torch.float32 and qs.absmax.numel() == n // 64
    assert quant.module_bytes(q) == n // 2 + stats
    up = base_layer(built, "model.layers.0.mlp.up_proj")
    assert quant.module_bytes(up) == 64 * 160 + 160 * 4  # int8 weight + one fp32 scale per row
    totals = built.base_bytes
    assert totals["mlp"] == 4 * (2 * (64 * 160 + 160 * 4) + (160 * 64 + 64 * 4))  # gate, up: 160 rows; down: 64
    assert totals["total"] == totals["attn"] + totals["mlp"] + totals["other"]


def dequantized(module) -> torch.Tensor:
    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    return (module.weight.data.float() * module.weight.SCB.float()[:, None] / 127)


@pytest.mark.parametrize("preset,name", [("nf4", "model.layers.1.mlp.down_proj"),
                                         ("fp4", "model.layers.1.self_attn.q_proj"),
                                         ("int8", "model.layers.1.mlp.gate_proj")])
def test_gradients_through_quantized_base_match_dequantized_reference(preset, name):
    """bitsandbytes has no autograd kernel for gemv_4bit on CPU: check grads against plain float math."""
    _, _, built = build(f"quant={preset}", "quant.compute_dtype=fp32", "adapter.dropout=0.0")
    lora = built.model.get_base_model().get_submodule(name)
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()  # peft starts B at zero, which would hide the A gradient
    w = dequantized(lora.base_layer)
    a, b, s = lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.scaling["default"]
    x = torch.randn(3, 5, lora.in_features, requires_grad=True)
    target = torch.randn(3, 5, lora.out_features)
    ((lora(x) - target) ** 2).sum().backward()
    got = (x.grad.clone(), a.grad.clone(), b.grad.clone())

    xr = x.detach().clone().requires_grad_(True)
    ar, br = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref_out = xr @ w.t() + s * (xr @ ar.t()) @ br.t()
    ((ref_out - target) ** 2).sum().backward()
    # int8 also quantizes the activations in forward, so its outputs (and hence all grads) are close, not equal
    tol = 2e-2 if preset == "int8" else 1e-4
    for g, r in zip(got, (xr.grad, ar.grad, br.grad)):
        assert torch.allclose(g, r, rtol=tol, atol=tol * r.abs().max().item()), (g - r).abs().max()
