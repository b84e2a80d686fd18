"""The memory model's table of saved tensors (qft.planning.saved) against what autograd really saves: each row's op is
built on small tensors, and the bytes `saved_tensors_hooks` sees saved during its forward must equal the row's."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import build
from torch import nn

from qft import adapter
from qft.planning import saved

B, S, H, R = 2, 8, 64, 8  # tiny_llama: hidden 64, 4 heads (2 KV heads) of 16, MLP 160
HEADS, KV_HEADS, HEAD_DIM, F_MLP, V, N = 4, 2, 16, 160, 300, 6
DIMS = {"t": B * S, "b": B, "s": S, "h": H, "f": F_MLP, "r": R, "q_dim": HEADS * HEAD_DIM, "heads": HEADS,
        "head_dim": HEAD_DIM, "V": V, "n": N, "d_in": H, "d_out": HEADS * HEAD_DIM}
BF16 = {"fp32": 4, "compute": 2, "bool": 1, "int64": 8, "attn": 2, "gate": 4, "up": 4, "input": 4}
FP32 = {**BF16, "compute": 4, "attn": 4}


def activation(*shape, dtype=torch.float32):
    """An activation as a layer hands it on: made by an op (not a leaf, so autocast does not cache its casts)."""
    return (torch.randn(*shape) * 1.0).to(dtype).requires_grad_() * 1


def saved_bytes(fn, held=()) -> int:
    """Bytes of the distinct storages autograd saves while fn runs, leaving out `held` (weights, buffers, tensors
    counted elsewhere)."""
    skip = {t.untyped_storage().data_ptr() for t in held}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@functools.cache
def projection(compute: str, proj: str = "q_proj", quant: str = "nf4"):
    """Layer 0's projection of the tiny model, as a run builds it (bitsandbytes base, peft LoRA, no dropout)."""
    _, _, built = build(f"quant={quant}", f"quant.compute_dtype={compute}", "adapter.dropout=0",
                        f"adapter.attn.r={R}", f"adapter.mlp.r={R}", "accel.fuse_projections=false")
    module = built.model.get_base_model().model.layers[0].self_attn.get_submodule(proj)
    return module, [*module.parameters(), *module.buffers()]


def lora(compute: str, proj: str, x_dtype, input_elsewhere: bool):
    module, weights = projection(compute, proj)
    x = activation(B, S, module.in_features, dtype=x_dtype)
    with bf16() if compute == "bf16" else torch.autocast("cpu", enabled=False):
        return saved_bytes(lambda: module(x), weights + ([x] if input_elsewhere else []))


def dropout(mask: nn.Module, compute: str = "fp32") -> int:
    """What a dropout module adds to a projection's saved tensors."""
    module, weights = projection(compute)
    x = activation(B, S, H)
    own = module.lora_dropout["default"]
    context = bf16 if compute == "bf16" else functools.partial(torch.autocast, "cpu", enabled=False)
    try:
        with context():
            plain = saved_bytes(lambda: module(x), weights)
            module.lora_dropout["default"] = mask.train()
            dropped = saved_bytes(lambda: module(x), weights)
    finally:
        module.lora_dropout["default"] = own
    return dropped - plain


def compiled_fast_mask() -> nn.Module:
    from qft.accel import masks

    mask = adapter.FastDropout(0.1)
    assert masks.compile_masks(nn.Sequential(mask)) == [mask]
    return mask


def rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(H)
    norm.weight.requires_grad_(False)
    x = activation(B, S, H)
    return saved_bytes(lambda: norm(x), [norm.weight])


def sdpa(padded: bool):
    """transformers' SDPA attention under bf16 autocast, on fp32 q, k and v as the rotary embedding leaves them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = HEADS // KV_HEADS, True, True
    q, k, v = activation(B, HEADS, S, HEAD_DIM), activation(B, KV_HEADS, S, HEAD_DIM), \
        activation(B, KV_HEADS, S, HEAD_DIM)
    mask = None
    if padded:  # causal, the first example's first two positions padding (left padding)
        mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
        mask[0, :, :, :2] = False
        mask[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # a padding row attends to itself, never to nothing
    with bf16():
        return saved_bytes(lambda: sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.25))


def swiglu():
    gate, up = activation(B, S, F_MLP), activation(B, S, F_MLP)  # a 4-bit layer's fp32 outputs
    return saved_bytes(lambda: F.silu(gate) * up)


def int8_matmul():
    """The frozen int8 layer alone: its input is kept on its node, where the hooks do not see it."""
    module, weights = projection("fp32", "q_proj", "int8")
    x = activation(B, S, H)
    return saved_bytes(lambda: module.get_base_layer()(x), weights)


def rotary(compiled: bool):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from qft.accel import rope

    q, k = activation(B, HEADS, S, HEAD_DIM), activation(B, KV_HEADS, S, HEAD_DIM)
    cos, sin = torch.randn(B, S, HEAD_DIM), torch.randn(B, S, HEAD_DIM)
    if compiled:
        return saved_bytes(lambda: rope._Rope.apply(q, k, cos, sin))
    return saved_bytes(lambda: apply_rotary_pos_emb(q, k, cos, sin))


def lm_head(setting: str):
    from qft.accel import fuse

    head = nn.Linear(H, V, bias=False).requires_grad_(False)
    if "fuse_projections" in setting:
        head.register_buffer("qft_cast", None, persistent=False)
        head.forward = fuse._CastHead(head)
    x = activation(B, 3, H)
    context = bf16 if "autocast" in setting else functools.partial(torch.autocast, "cpu", enabled=False)
    with context():
        head(x)  # the fused head makes its cast at the first call, and keeps it as a buffer
        return saved_bytes(lambda: head(x), [head.weight, *head.buffers()])


def cross_entropy():
    logits = activation(N, V)
    return saved_bytes(lambda: F.cross_entropy(logits, torch.randint(0, V, (N,)), reduction="sum"))


MEASURE = {
    ("rmsnorm", "any"): (rmsnorm, FP32),
    ("lora", "autocast"): (lambda: lora("bf16", "q_proj", torch.float32, False), BF16),
    # o_proj reading SDPA's bf16 output on the CPU: peft's cast to fp32 and back makes the "autocast" row's copy
    ("lora", "autocast, bf16 input on the CPU"): (lambda: lora("bf16", "o_proj", torch.bfloat16, False), BF16),
    ("lora", "fp32"): (lambda: lora("fp32", "q_proj", torch.float32, False), FP32),
    ("lora", "fp32, input saved elsewhere"): (lambda: lora("fp32", "q_proj", torch.float32, True), FP32),
    ("dropout", "torch"): (lambda: dropout(nn.Dropout(0.1)), FP32),
    ("dropout", "fast"): (lambda: dropout(adapter.FastDropout(0.1)), FP32),
    ("dropout", "fast, compiled_masks"): (lambda: dropout(compiled_fast_mask(), "bf16"), BF16),
    ("sdpa", "padded"): (lambda: sdpa(True), BF16),
    ("sdpa", "unpadded"): (lambda: sdpa(False), BF16),
    ("swiglu", "any"): (swiglu, FP32),
    ("int8 matmul", "any"): (int8_matmul, FP32),
    ("rotary", "any"): (lambda: rotary(False), FP32),
    ("rotary", "compiled_rope"): (lambda: rotary(True), FP32),
    ("lm_head", "autocast"): (lambda: lm_head("autocast"), BF16),
    ("lm_head", "autocast, fuse_projections"): (lambda: lm_head("autocast, fuse_projections"), BF16),
    ("lm_head", "fp32"): (lambda: lm_head("fp32"), FP32),
    ("cross_entropy", "any"): (cross_entropy, FP32),
}
# a case measured against another row's bytes: (op, what is measured) -> the row
AS_ROW = {("lora", "autocast, bf16 input on the CPU"): "autocast"}


def test_every_row_is_measured_where_it_applies():
    rows = {(r.op, r.setting) for r in saved.TABLE}
    assert {(op, AS_ROW.get((op, s), s)) for op, s in MEASURE} == {(r.op, r.setting) for r in saved.TABLE
                                                                    if r.device == "any"}
    assert {k for k in rows if saved.row(*k).device == "cuda"} == {("lora", "autocast, input in compute dtype"),
                                                                   ("dropout", "torch, cuda")}


@pytest.mark.parametrize("case", list(MEASURE), ids=lambda c: f"{c[0]}[{c[1]}]")
def test_a_rows_bytes_are_what_autograd_saves(case):
    measure, dtypes = MEASURE[case]
    row = saved.row(case[0], AS_ROW.get(case, case[1]))
    dims = {**DIMS, "kv_dim": HEADS * HEAD_DIM if row.setting == "padded" else KV_HEADS * HEAD_DIM}
    expected = saved.nbytes(row.op, row.setting, dims, dtypes) if row.hooks else 0
    assert measure() == expected, [(what, shape, dtype) for what, shape, dtype in row.tensors]
