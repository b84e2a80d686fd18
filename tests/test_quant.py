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
    _, _, built = build("quant.compute_dtype=bf16")  # auto would be fp32 on a CPU without bf16 units
    base = built.model.get_base_model()
    assert base.model.embed_tokens.weight.dtype == torch.float32
    assert base.model.norm.weight.dtype == torch.float32
    assert base.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("double_quant", [True, False])
def test_base_bytes_are_the_closed_forms_of_the_bitsandbytes_layouts(double_quant):
    _, _, built = build(f"quant.attn.double_quant={str(double_quant).lower()}", "quant.mlp.bits=8")
    q = base_layer(built, "model.layers.0.self_attn.q_proj")
    qs = q.weight.quant_state
    assert qs.blocksize == 64 and qs.code.numel() == 16  # NF4: a 16-entry code book, one absmax per 64 weights

    def nf4(n):  # packed 4-bit weights + absmax per block + the code book (+ double quantization's state)
        if not double_quant:
            return n // 2 + (n // 64) * 4 + 16 * 4
        return n // 2 + (n // 64) * 1 + 16 * 4 + -(-(n // 64) // 256) * 4 + 256 * 4 + 4
    assert quant.module_bytes(q) == (3208 if double_quant else 2368) == nf4(64 * 64)
    up = base_layer(built, "model.layers.0.mlp.up_proj")
    assert quant.module_bytes(up) == 64 * 160 + 160 * 4  # int8 weight + one fp32 scale per row
    totals = built.base_bytes
    # tiny_llama, 4 layers: q and o 64x64, k and v 32x64; gate and up 160x64, down 64x160
    assert totals["attn"] == 4 * (2 * nf4(4096) + 2 * nf4(2048)) == (42880 if double_quant else 28672)
    assert totals["mlp"] == 4 * (2 * (64 * 160 + 160 * 4) + (160 * 64 + 64 * 4)) == 129024
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
    # bitsandbytes' CPU int8 path in training mode multiplies by the dequantized weight (measured: 6e-8 from this
    # reference); in eval mode, and on CUDA, LLM.int8 also quantizes the activations (the test below; on a GPU,
    # scripts/gpu_check.sh)
    tol = 1e-4
    for g, r in zip(got, (xr.grad, ar.grad, br.grad)):
        assert torch.allclose(g, r, rtol=tol, atol=tol * r.abs().max().item()), (g - r).abs().max()


@pytest.mark.parametrize("flags,want,kind", [("fpu avx2 amx_bf16 amx_tile", "bf16", "amx_bf16"),
                                             ("fpu avx2 avx512f avx512_bf16", "bf16", "avx512_bf16"),
                                             ("fpu avx2 fma", "fp32", "avx2")])
def test_auto_compute_dtype_follows_the_cpus_bf16_units(monkeypatch, flags, want, kind):
    from pathlib import Path

    from qft import model, record, run
    from conftest import make_cfg

    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"model name\t: Test CPU\nflags\t\t: {flags}\n"
                        if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    assert model.compute_dtype_name("auto", "cpu") == want and model.compute_dtype_name("fp32", "cpu") == "fp32"
    cfg = make_cfg("device=cpu")
    run._name_auto_dtype(cfg)  # what the record and its hash carry
    assert cfg.quant.compute_dtype == want
    assert record.cpu_kind() == ("Test CPU", kind)


def test_int8_on_cpu_trains_on_the_dequantized_weight_and_scores_with_llm_int8(caplog):
    """A stack fact the int8 studies rest on (bitsandbytes 0.50 on CPU): in training mode Linear8bitLt multiplies by
    the dequantized weight (MatMul8bitFp: int8 weights, full-precision activations); in eval mode it runs LLM.int8
    proper (MatMul8bitLt: fp16 activations quantized to int8 per row, outlier columns over the threshold kept in
    fp16). So on CPU an int8 base is trained through one matmul and scored through another. bitsandbytes logs its
    fp16 cast at every eval matmul; qft passes each distinct message once."""
    import logging

    from qft.quant import int8

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64)
    q = int8.Int8().quantize(linear, {"threshold": 6.0}, torch.float32, "cpu")
    x = torch.randn(8, 256)
    x[:, 3] *= 20  # one outlier column, over the threshold
    w = q.weight.data.float() * q.weight.SCB.float()[:, None] / 127
    reference = x @ w.t() + q.bias

    q.train()
    assert torch.allclose(q(x), reference, atol=1e-4)

    for f in int8.CAST_LOG.filters:
        f.seen.clear()
    q.eval()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=int8.CAST_LOG.name):
        scored = [q(x) for _ in range(3)]
    err = (scored[0].float() - reference).abs().max().item()
    assert 1e-3 < err < 0.05 * reference.abs().max().item()  # activation quantization: not the training matmul
    assert torch.equal(scored[0], scored[2])
    assert [r.getMessage() for r in caplog.records if "cast" in r.getMessage()] == \
        ["MatMul8bitLt: inputs will be cast from torch.float32 to float16 during quantization"]


@pytest.mark.parametrize("order", [("all", "deep"), ("deep", "all")])
def test_overlapping_depth_groups_later_wins_for_bits(order):
    """README's rule: depth groups apply in the order written, so where two overlap the later one's bits hold."""
    from qft import layers, model
    from conftest import make_cfg

    groups = {"all": "{layers:[0,3],bits:8}", "deep": "{layers:[2,3],bits:16,types:[attn]}"}
    cfg = make_cfg("quant.attn.bits=4", "quant.mlp.bits=4", *(f"+quant.depth_groups.{g}={groups[g]}" for g in order))
    assert list(cfg.quant.depth_groups) == list(order)
    found = layers.classify(model.load(model.resolve(cfg.model, cfg.cache_dir)), "llama")
    got = quant.plan(cfg.quant, found)
    for layer in found:
        overlap = layer.layer_type == "attn" and layer.depth >= 2
        want = (16 if order[-1] == "deep" else 8) if overlap else 8
        assert got[layer.name]["bits"] == want, layer.name
