"""What autograd saves for backward, per op and setting: the one table the memory model's activation terms read.

Each row names an op of a training step, a setting of the switches that decide what it saves, and the tensors it
saves (shape in the step's dimensions, dtype). tests/test_saved.py counts what `saved_tensors_hooks` sees for each
row's op; a row held on the autograd node itself (bitsandbytes' int8 input) says so (`hooks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# Dimensions: t tokens of a micro-batch (b x s), h hidden, f MLP width, d_in and d_out a projection's widths, r its
# rank, q_dim and kv_dim the attention widths SDPA gets, heads, head_dim, rows the positions the LM head runs on
# (b x (k+1)), n the answer tokens, V the vocabulary. Dtypes: fp32, int64, compute (the compute dtype), bool (one
# byte), attn (SDPA's dtype: fp32 with quant.attention_dtype=fp32, else compute), gate and up (what the gate and up
# projections return: fp32 from a 4-bit or int8 layer, else the compute dtype), input (an int8 layer's input).


@dataclass(frozen=True)
class Saved:
    """One row: what `op` saves under `setting`."""

    op: str
    setting: str
    tensors: tuple  # (what, shape as dimension names or ints, dtype)
    hooks: bool = True  # saved through save_for_backward, so saved_tensors_hooks see it
    device: str = "any"  # "cuda": a row only a CUDA run takes


TABLE = (
    Saved("rmsnorm", "any", (("input", ("t", "h"), "fp32"), ("reciprocal rms", ("t",), "fp32"))),
    # peft's side path B(A(dropout(x))) * scaling; the frozen layer's own matmul saves nothing the hooks see
    Saved("lora", "autocast", (("input cast", ("t", "d_in"), "compute"), ("middle", ("t", "r"), "compute"),
                               ("A cast", ("r", "d_in"), "compute"), ("B cast", ("d_out", "r"), "compute"))),
    # o_proj's LoRA reading SDPA's output already in the compute dtype, on CUDA: no copy of the input (SDPA keeps
    # it). On the CPU peft's 4-bit LoRA sees no autocast (it asks CUDA's), casts the input to fp32, and autocast
    # casts that back: the "autocast" row.
    Saved("lora", "autocast, input in compute dtype", (("middle", ("t", "r"), "compute"),
                                                       ("A cast", ("r", "d_in"), "compute"),
                                                       ("B cast", ("d_out", "r"), "compute")), device="cuda"),
    Saved("lora", "fp32", (("input", ("t", "d_in"), "fp32"), ("middle", ("t", "r"), "fp32"))),
    # the input is saved already (a sibling projection's side path, SDPA's output)
    Saved("lora", "fp32, input saved elsewhere", (("middle", ("t", "r"), "fp32"),)),
    Saved("dropout", "torch", (("mask", ("t", "d_in"), "fp32"),)),
    Saved("dropout", "torch, cuda", (("mask", ("t", "d_in"), "bool"),), device="cuda"),
    Saved("dropout", "fast", (("mask", ("t", "d_in"), "bool"),)),
    Saved("dropout", "fast, compiled_masks", (("mask", ("t", "d_in"), "bool"),)),
    # SDPA's flash kernel: q, k, v, the output and the log-sum-exp; with a padding mask, its additive copy
    Saved("sdpa", "padded", (("q", ("t", "q_dim"), "attn"), ("k", ("t", "kv_dim"), "attn"),
                             ("v", ("t", "kv_dim"), "attn"), ("output", ("t", "q_dim"), "attn"),
                             ("log-sum-exp", ("t", "heads"), "fp32"), ("mask", ("b", "s", "s"), "attn"))),
    Saved("sdpa", "unpadded", (("q", ("t", "q_dim"), "attn"), ("k", ("t", "kv_dim"), "attn"),
                               ("v", ("t", "kv_dim"), "attn"), ("output", ("t", "q_dim"), "attn"),
                               ("log-sum-exp", ("t", "heads"), "fp32"))),
    Saved("swiglu", "any", (("silu input", ("t", "f"), "gate"), ("silu output", ("t", "f"), "gate"),
                            ("up", ("t", "f"), "up"))),
    # its input, kept on the autograd node (ctx.A), past the hooks and checkpointing
    Saved("int8 matmul", "any", (("input", ("t", "d_in"), "input"),), hooks=False),
    # cos and sin, made once a step and read by every layer's rotary embedding (counted once)
    Saved("rotary", "any", (("cos", ("t", "head_dim"), "fp32"), ("sin", ("t", "head_dim"), "fp32"))),
    Saved("rotary", "compiled_rope", (("cos", ("t", "head_dim"), "fp32"), ("sin", ("t", "head_dim"), "fp32"))),
    # the LM head under autocast keeps its weight's cast; with fused projections the cast is made once and kept
    # as the head's buffer (qft.accel.fuse), a fixed cost rather than a step's activation
    Saved("lm_head", "autocast", (("weight cast", ("V", "h"), "compute"),)),
    Saved("lm_head", "autocast, fuse_projections", ()),
    Saved("lm_head", "fp32", ()),  # a frozen weight: the matmul keeps only the weight itself
    # the loss over the n answer rows: log-softmax's output, the targets and nll's total weight
    Saved("cross_entropy", "any", (("log-softmax", ("n", "V"), "fp32"), ("targets", ("n",), "int64"),
                                   ("total weight", (), "fp32"))),
)

_ROWS = {(row.op, row.setting): row for row in TABLE}


def row(op: str, setting: str) -> Saved:
    """The row of `op` under `setting`; raises KeyError where the table has none."""
    return _ROWS[(op, setting)]


def nbytes(op: str, setting: str, dims: dict, dtypes: dict) -> int:
    """The bytes row (`op`, `setting`) saves: each tensor's elements (its shape over `dims`) times its dtype's size
    in `dtypes`."""
    return sum(math.prod(dims[d] if isinstance(d, str) else d for d in shape) * dtypes[dtype]
               for _, shape, dtype in row(op, setting).tensors)
