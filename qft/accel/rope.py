"""HF's rotary embedding of q and k as one compiled pass each (`accel.compiled_rope`, qft.accel.kernels.rope).

The hook is the per-module rotary function transformers keeps for its `kernels` hub; a probe at install decides, per
architecture, whether that function is the one computed here, bit for bit.
"""

from __future__ import annotations

import types

import torch
from torch.autograd.function import once_differentiable

from qft.accel.probe import same_bits, spread


class _Rope(torch.autograd.Function):
    """HF's rotary embedding of q and k, forward and backward, as one compiled pass each: the same bits as HF's ops
    (a NaN's sign aside), outputs and gradients in their layouts (a norm's weight gradient sums in that order)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from qft.accel import kernels

        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)  # an output nothing read hands its input no gradient, as HF's ops do
        outs = []
        for x in (q, k):
            out = torch.empty_like(x)  # x's layout, as HF's ops leave it
            kernels.rope(x, cos, sin, out)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        from qft.accel import kernels

        cos, sin = ctx.saved_tensors
        outs = []
        for g, needed in zip(grads, ctx.needs_input_grad):
            out = None
            if g is not None and needed:
                g = g if g.stride(-1) == 1 else g.contiguous()
                out = torch.empty(g.shape)  # contiguous, as autograd's sum of HF's terms is laid out
                kernels.rope(g, cos, sin, out, True)  # the gradient
            outs.append(out)
        return (*outs, None, None)


def _rope_fits(q, k, cos, sin) -> bool:
    """Whether _Rope computes what HF's function does on `q`, `k`, `cos`, `sin`: fp32 on the CPU, (batch, heads, seq,
    dim) with shared batch, seq and an even dim, cos and sin (1 or batch, seq, dim) without gradients."""
    t = (q, k, cos, sin)
    if any(not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu" for x in t):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or q.shape[3] % 2:
        return False
    batch, _, seq, dim = q.shape
    return (k.shape[0], k.shape[2], k.shape[3]) == (batch, seq, dim) and cos.shape[0] in (1, batch) \
        and tuple(cos.shape[1:]) == (seq, dim) and not (cos.requires_grad or sin.requires_grad) \
        and cos.is_contiguous() and sin.is_contiguous() and q.stride(-1) == k.stride(-1) == 1


def _compiled_rope(self, *args, **kwargs):
    """The forward bound to rotary wrapper `self` (transformers' `kernels` one): _Rope where it fits and
    `self.compiled`, else the wrapped function."""
    if self.compiled and len(args) == 4 and not kwargs and _rope_fits(*args):
        return _Rope.apply(*args)
    return type(self).forward(self, *args, **kwargs)


def _rope_is_hfs(func) -> bool:
    """Whether rotary function `func` computes what _Rope does, bit for bit forward and backward, on spread values
    with signed zeros, a broadcast cos and GQA's fewer k heads."""
    g = torch.Generator().manual_seed(0)

    def signed(*shape):
        x = spread(shape, g)
        return x.masked_fill(torch.rand(shape, generator=g) < 0.05, 0.0).mul_(
            torch.randint(0, 2, shape, generator=g) * 2 - 1)

    cos, sin, got = signed(1, 5, 8), signed(1, 5, 8), []
    inputs = [signed(2, 5, 3 * 8), signed(2, 5, 1 * 8)]
    grads = [signed(2, 3, 5, 8), signed(2, 1, 5, 8)]
    for f in (func, lambda *a: _Rope.apply(*a)):
        x = [t.clone().requires_grad_() for t in inputs]
        qk = [t.view(2, 5, -1, 8).transpose(1, 2) for t in x]
        try:
            outs = f(*qk, cos, sin)
            torch.autograd.backward(outs, grads)
        except Exception:  # a rotary function of another signature
            return False
        got.append([*outs, *(t.grad for t in x)])
    return all(same_bits(a, b) for a, b in zip(*got))


def compile_rope(model) -> list:
    """Switch the rotary embedding of each attention module of `model` to one compiled pass forward and backward
    (accel.compiled_rope); returns the rotary functions switched ([] without numba or transformers' wrapper).

    Only where a probe finds the architecture's function computes the same bits (_rope_is_hfs). Compiles before the
    probe: numba's OpenMP start-up would reset torch's thread count. HF's ops take ten passes forward, fourteen back."""
    try:
        from qft.accel import kernels
    except ImportError:  # numba is not installed
        return []
    switched, checked = [], {}
    for module in model.modules():
        for func in getattr(module, "_kernel_funcs", {}).values():
            if getattr(func, "kernel_layer_name", None) != "rotary_pos_emb":
                continue
            if type(func) not in checked:
                kernels.warm()  # before the probe runs a loop (once a process; nothing where no function is probed)
                checked[type(func)] = _rope_is_hfs(type(func)().__call__)
            if checked[type(func)]:
                func.compiled = True
                func.forward = types.MethodType(_compiled_rope, func)
                switched.append(func)
    return switched
