"""The fast dropout mask as compiled loops (numba): one pass over the input where torch's ops make five.

Under bf16 autocast, `adapter.FastDropout` compares 16-bit random lanes with its threshold, casts the 1-byte mask to
fp32, multiplies by the input and by the scale, and the LoRA A matmul's autocast then casts the dropped input to bf16:
five passes over a 1024 x 576 (or x 1536) tensor for each of SmolLM2's 210 projections a step, and in backward a cast
up, the byte cast and two multiplies again. On a CPU whose matmuls are fast (AMX) those passes are a sixth of a step.
Each loop here computes the same IEEE operations in the same order, (keep * x) * scale in fp32, rounded to bf16 to
nearest even with integer arithmetic as torch's vectorized cast rounds (a NaN written as it writes one, 0xFFFF), so
the values, the kept mask and the gradient are the same bits (tests/test_kernels.py); no fast-math, no contraction.
Compiled once per machine (numba's on-disk cache), run on as many threads as torch's ops.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True, parallel=True, boundscheck=False, fastmath=False)


@intrinsic
def _bits(typingctx, value):
    """A float32's bits as a uint32 (an LLVM bitcast: numba has no scalar view)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _float(typingctx, bits):
    """A uint32's bits as a float32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _bf16(v):
    """Round to bf16, nearest even, as torch's vectorized fp32 -> bf16 cast does (NaN -> 0xFFFF)."""
    b = _bits(v)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0xFFFF)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(**_JIT)
def _drop(x, lanes, threshold, scale, out, keep):
    """out = (keep * x) * scale in fp32, keep = lanes >= threshold."""
    s = np.float32(scale)
    for i in prange(x.size):
        keep[i] = lanes[i] >= threshold
        out[i] = (np.float32(keep[i]) * x[i]) * s


@numba.njit(**_JIT)
def _drop_bf16(x, lanes, threshold, scale, out, keep):
    """The same, rounded to bf16: out holds its bits (uint16)."""
    s = np.float32(scale)
    for i in prange(x.size):
        keep[i] = lanes[i] >= threshold
        out[i] = _bf16((np.float32(keep[i]) * x[i]) * s)


@numba.njit(**_JIT)
def _undrop(grad, keep, scale, out):
    """out = (keep * grad) * scale in fp32."""
    s = np.float32(scale)
    for i in prange(grad.size):
        out[i] = (np.float32(keep[i]) * grad[i]) * s


@numba.njit(**_JIT)
def _undrop_bf16(grad, keep, scale, out):
    """The same for a bf16 gradient (its bits as uint16), widened to fp32 exactly first."""
    s = np.float32(scale)
    for i in prange(grad.size):
        out[i] = (np.float32(keep[i]) * _float(np.uint32(grad[i]) << np.uint32(16))) * s


def _flat(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's flat numpy view (bf16 as the uint16 of its bits)."""
    t = t.detach().reshape(-1)
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def drop(x: torch.Tensor, lanes: torch.Tensor, threshold: int, scale: float, out: torch.Tensor,
         keep: torch.Tensor) -> None:
    """Fill out ((keep * x) * scale: fp32, or rounded to bf16) and keep (lanes >= threshold); contiguous CPU tensors."""
    (_drop_bf16 if out.dtype == torch.bfloat16 else _drop)(_flat(x), _flat(lanes), threshold, scale, _flat(out),
                                                            _flat(keep))


def undrop(grad: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Fill out (fp32) with (keep * grad) * scale; grad fp32 or bf16, contiguous CPU tensors."""
    (_undrop_bf16 if grad.dtype == torch.bfloat16 else _undrop)(_flat(grad), _flat(keep), scale, _flat(out))


def warm() -> None:
    """Compile every loop (or load numba's cached build) now, not inside a step, on as many threads as torch uses.
    numba's OpenMP start-up sets the process's OpenMP thread count, torch's own included (the two share one libgomp
    once torch has loaded it): torch's count is put back, and the record's `threads` stays true."""
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    torch.set_num_threads(threads)
    x, lanes, keep, back = torch.ones(64), torch.zeros(64, dtype=torch.int16), torch.empty(64, dtype=torch.bool), \
        torch.empty(64)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(64, dtype=dtype)
        drop(x, lanes, 0, 1.0, out, keep)
        undrop(out, keep, 1.0, back)
