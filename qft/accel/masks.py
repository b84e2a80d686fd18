"""The fast dropout masks as one compiled pass each (`accel.compiled_masks`): the same bits as torch's ops.

The compiled path itself is `adapter.FastDropout`'s (qft.accel.kernels.drop, undrop, random_bits); installing it here
turns it on where it computes what torch's ops compute.
"""

from __future__ import annotations

from torch import nn

from qft import adapter


def compile_masks(model: nn.Module) -> list:
    """Switch every FastDropout of `model` to one compiled pass (qft.accel.kernels), the same bits; returns the masks
    switched ([] without numba). Compiles here, before any step, keeping torch's thread count."""
    try:
        from qft.accel import kernels
    except ImportError:  # numba is not installed
        return []
    masks = []
    for m in model.modules():
        if isinstance(m, adapter.FastDropout):
            m.compiled = True
            masks.append(m)
        # masks whose dropped input more than one matmul reads hand them fp32
        if isinstance(m, adapter.SharedDropout) and isinstance(m.inner, adapter.FastDropout):
            m.inner.one_reader = False
        if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict):  # a variant (DoRA) reads x beside lora_A
            for key, drop in m.lora_dropout.items():
                if isinstance(drop, adapter.FastDropout) and (getattr(m, "lora_variant", None) or {}).get(key):
                    drop.one_reader = False
    if masks:
        kernels.warm()
    return masks
