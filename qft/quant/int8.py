"""8-bit LLM.int8 through bitsandbytes (`Linear8bitLt`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from qft.quant.registry import Backend, register


class _Once(logging.Filter):
    """A logging filter that passes each distinct message once: bitsandbytes logs "inputs will be cast ... to
    float16" at every LLM.int8 matmul of an evaluation."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record):
        key = record.getMessage()
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


CAST_LOG = logging.getLogger("bitsandbytes.autograd._functions")
CAST_LOG.addFilter(_Once())


class Int8(Backend):
    """8-bit LLM.int8 (`Linear8bitLt`, threshold from the settings)."""

    name, bits = "int8", 8
    pins_input = True  # bitsandbytes' int8 matmul keeps its input on its autograd node (ctx.A)

    @property
    def modules(self):
        import bitsandbytes as bnb

        return (bnb.nn.Linear8bitLt,)

    def quantize(self, linear, s, compute_dtype, device):
        import bitsandbytes as bnb

        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=float(s["threshold"]))
        q.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.float(), requires_grad=False)
        return q.to(device)  # bitsandbytes quantizes on the move to a device

    def tensors(self, q):
        return {**super().tensors(q), "SCB": q.weight.SCB}

    def rebuild(self, t, s, in_f, out_f, compute_dtype, device, at):
        import bitsandbytes as bnb

        q = bnb.nn.Linear8bitLt(in_f, out_f, bias="bias" in t, has_fp16_weights=False,
                                threshold=float(s["threshold"]), device=at)
        q.weight = bnb.nn.Int8Params(t["weight"].to(device), requires_grad=False, has_fp16_weights=False)
        q.weight.CB, q.weight.SCB = q.weight.data, t["SCB"].to(device)
        if "bias" in t:
            q.bias = nn.Parameter(t["bias"].to(device), requires_grad=False)
        return q

    def weight(self, q):
        """The int8 rows times their scale (after a first forward bitsandbytes keeps the scales in its state)."""
        scb = q.weight.SCB if getattr(q.weight, "SCB", None) is not None else q.state.SCB
        return q.weight.data.float() * scb.float()[:, None] / 127

    def describe(self, q):
        return "int8"

    def format(self, s, compute_dtype):
        return "int8"

    def module_bytes(self, q):
        scb = getattr(q.weight, "SCB", None)  # one fp32 scale per row
        return super().module_bytes(q) + (scb.numel() * scb.element_size() if isinstance(scb, torch.Tensor) else 0)

    def weight_bytes(self, s, in_f, out_f, compute_bytes, bias):
        """A byte a weight and an fp32 scale per output row."""
        return in_f * out_f + out_f * 4 + (out_f * 4 if bias else 0)

    def work_bytes(self, n, compute_bytes, device):
        """On the CPU the weight is dequantized to its input's dtype (fp32) in the forward; the backward
        dequantizes it for the input's gradient everywhere."""
        return (4 * n if device == "cpu" else 0), 4 * n


register(Int8())
