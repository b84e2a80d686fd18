"""A toy quantization backend in one file, as docs/extending.md describes: 4-bit round-to-nearest in plain torch.

Each block of 32 weights along a row keeps an fp32 scale (its absmax / 7) and 4-bit codes in [-7, 7], two to a
byte. Loading this file registers it for `quant.<group>.bits=4 quant.<group>.quant_type=rtn4`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qft.quant.registry import Backend, register

BLOCK = 32


class RTN4Linear(nn.Linear):
    """A frozen projection held as packed 4-bit codes and per-block scales; peft wraps it as an nn.Linear."""

    def __init__(self, in_f: int, out_f: int, codes: torch.Tensor, scales: torch.Tensor, bias=None):
        nn.Module.__init__(self)  # no random init: the frozen weight is the codes
        self.in_features, self.out_features = in_f, out_f
        self.weight = nn.Parameter(codes, requires_grad=False)  # uint8, (out_f, in_f // 2)
        self.register_buffer("scales", scales)  # fp32, (out_f, in_f // BLOCK)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        lo, hi = (self.weight & 15).to(torch.int8) - 8, (self.weight >> 4).to(torch.int8) - 8
        q = torch.stack([lo, hi], dim=-1).reshape(self.out_features, -1, BLOCK).float()
        return (q * self.scales[..., None]).reshape(self.out_features, self.in_features)

    def forward(self, x):
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = w.float().reshape(w.shape[0], -1, BLOCK)
    scales = blocks.abs().amax(-1).clamp(min=1e-12) / 7
    q = (blocks / scales[..., None]).round().clamp(-7, 7).to(torch.int16).reshape(w.shape[0], -1, 2) + 8
    return (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8), scales


class RTN4(Backend):
    name, bits, quant_types, modules = "rtn4", 4, ("rtn4",), (RTN4Linear,)

    def quantize(self, linear, s, compute_dtype, device):
        codes, scales = pack(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data.float()
        return RTN4Linear(linear.in_features, linear.out_features, codes, scales, bias).to(device)

    def tensors(self, q):
        return {**super().tensors(q), "scales": q.scales}

    def rebuild(self, t, s, in_f, out_f, compute_dtype, device, at):
        return RTN4Linear(in_f, out_f, t["weight"], t["scales"], t.get("bias")).to(device)

    def weight(self, q):
        return q.dequantized()

    def describe(self, q):
        return "rtn4"

    def format(self, s, compute_dtype):
        return "rtn4"

    def weight_bytes(self, s, in_f, out_f, compute_bytes, bias):
        return in_f * out_f // 2 + out_f * (in_f // BLOCK) * 4 + (out_f * 4 if bias else 0)


register(RTN4())
