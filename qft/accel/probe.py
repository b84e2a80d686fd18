"""What an exact speed switch is held to: the same bits, checked at install on values whose sums cancel."""

from __future__ import annotations

import torch


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether tensors `x` and `y` have equal dtype, shape and bits (signed zeros and NaN payloads count)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(as_int[x.element_size()]),
                                                                     y.view(as_int[y.element_size()]))


def spread(shape, generator: torch.Generator) -> torch.Tensor:
    """fp32 values of `shape` from `generator` over 2^-12..2^12 whose partial sums cancel: the exact switches' probe
    input, on which another summation order or rounding shows where randn values may round it away."""
    return torch.randn(shape, generator=generator).mul_(torch.randint(-12, 13, shape, generator=generator).exp2())
