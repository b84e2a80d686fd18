"""16 bits: the frozen weight kept as a plain `nn.Linear` in the compute dtype."""

from __future__ import annotations

from torch import nn

from qft.quant.registry import Backend, register


class Dense(Backend):
    """16 bits: the frozen weight as a plain nn.Linear in the compute dtype."""

    name, bits, modules = "dense", 16, (nn.Linear,)
    fuses = True

    def quantize(self, linear, s, compute_dtype, device):
        q = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=compute_dtype)
        q.weight = nn.Parameter(linear.weight.data.to(compute_dtype), requires_grad=False)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        return q.to(device)

    def rebuild(self, t, s, in_f, out_f, compute_dtype, device, at):
        q = nn.Linear(in_f, out_f, bias="bias" in t, dtype=compute_dtype, device=at)
        q.weight = nn.Parameter(t["weight"].to(device), requires_grad=False)
        if "bias" in t:
            q.bias = nn.Parameter(t["bias"].to(device), requires_grad=False)
        return q

    def weight_bytes(self, s, in_f, out_f, compute_bytes, bias):
        return (in_f * out_f + (out_f if bias else 0)) * compute_bytes

    def fuse_kind(self, q):
        return "stored"


register(Dense())
