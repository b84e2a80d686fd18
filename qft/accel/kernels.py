"""Compiled loops (numba) for the memory-bound work around each LoRA projection: one pass where torch's ops make
several, the same bits (tests/test_kernels.py).

The fast dropout mask and its random bits (accel.compiled_masks), LoRA's sum of frozen and scaled LoRA outputs
(accel.compiled_sums) and the rotary embedding (accel.compiled_rope). Each loop makes torch's IEEE operations in
torch's order (no fast-math, no contraction); compiled once per machine (numba's cache), run on torch's thread count.
What each saves: docs/memory.md and benchmarks/README.md.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import intrinsic, overload

_WARMED: list = []  # not empty once warm() has run the loops
_JIT = dict(cache=True, nogil=True, parallel=True, boundscheck=False, fastmath=False)
LOOPS = ("drop", "undrop", "lora_sum", "lora_sum_grad", "random_bits", "rope")  # public (benchmarks/step_ops.py)


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


def _f32(v):
    """A value as fp32: a bf16's bits (uint16: `_flat` is the only maker of the loops' integer views of floats)
    widened exactly, an fp32 as it is."""


@overload(_f32, inline="always")
def _f32_typed(v):
    if isinstance(v, types.Integer):
        return lambda v: _float(np.uint32(v) << np.uint32(16))
    return lambda v: v


def _scaled(v, s):
    """v * s in v's own dtype, as fp32: a bf16 times a scalar is computed in fp32 and rounded (torch's opmath)."""


@overload(_scaled, inline="always")
def _scaled_typed(v, s):
    if isinstance(v, types.Integer):
        return lambda v, s: _f32(_bf16(_f32(v) * s))
    return lambda v, s: v * s


def _stored(v, out):
    """An fp32 value as `out` holds it: fp32, or rounded to bf16 bits."""


@overload(_stored, inline="always")
def _stored_typed(v, out):
    if out.dtype == types.uint16:
        return lambda v, out: _bf16(v)
    return lambda v, out: v


@numba.njit(**_JIT)
def _drop(x, lanes, threshold, scale, out, keep):
    """out = (keep * x) * scale in fp32, stored as out holds it (fp32, or rounded to bf16), keep = lanes >= threshold."""
    s = np.float32(scale)
    for i in prange(x.size):
        keep[i] = lanes[i] >= threshold
        out[i] = _stored((np.float32(keep[i]) * x[i]) * s, out)


@numba.njit(**_JIT)
def _undrop(grad, keep, scale, out):
    """out = (keep * grad) * scale in fp32, a bf16 gradient (its bits) widened exactly first."""
    s = np.float32(scale)
    for i in prange(grad.size):
        out[i] = (np.float32(keep[i]) * _f32(grad[i])) * s


@numba.njit(**_JIT)
def _sum(y, width, lo, h, scale, out):
    """out = y[:, lo:lo+n] + h * scale, by rows of n: y the frozen output, rows of `width`, h the LoRA output, the
    product in h's dtype, the sum in fp32, stored as out holds it; all flat, bf16 as its bits (uint16)."""
    s = np.float32(scale)
    rows = y.size // width
    n = h.size // rows
    for r in prange(rows):
        yr, hr, o = y[r * width + lo:r * width + lo + n], h[r * n:(r + 1) * n], out[r * n:(r + 1) * n]
        for c in range(n):  # a row's own slices: LLVM vectorizes this loop, not one indexed from the flat arrays
            o[c] = _stored(_f32(yr[c]) + _scaled(hr[c], s), o)


@numba.njit(**_JIT)
def _sum_grad(grad, scale, frozen, lora):
    """frozen = bf16(grad), lora = bf16(frozen * scale): bits of both."""
    s = np.float32(scale)
    for i in prange(grad.size):
        g = _bf16(grad[i])
        frozen[i] = g
        lora[i] = _bf16(_f32(g) * s)


@numba.njit(**_JIT)
def _rope(x, xs, cos, sin, crows, out, os, grad):
    """Rotary embedding of flat x (batch, heads, seq, dim at strides xs; shape in xs[3:]) into flat out (strides os):
    HF's x * cos + rotate_half(x) * sin, cos and sin rows of dim, position r = b * seq + t at r % crows. With `grad`,
    that map's gradient as autograd makes it from HF's ops, + 0 as the slices' zeros make it (-0 sums to +0).
    A NaN's sign and payload are unspecified (LLVM may fold a negation)."""
    batch, heads, seq, dim = xs[3], xs[4], xs[5], xs[6]
    half = dim // 2
    zero = np.float32(0.0)
    for r in prange(batch * seq):
        b, t = r // seq, r % seq
        c, s = cos[(r % crows) * dim:(r % crows + 1) * dim], sin[(r % crows) * dim:(r % crows + 1) * dim]
        for h in range(heads):
            i, o = b * xs[0] + h * xs[1] + t * xs[2], b * os[0] + h * os[1] + t * os[2]
            xr, orow = x[i:i + dim], out[o:o + dim]
            if grad:
                for j in range(half):
                    orow[j] = (xr[j] * c[j] + xr[j + half] * s[j + half]) + zero
                    orow[j + half] = (xr[j + half] * c[j + half] - xr[j] * s[j]) + zero
            else:
                for j in range(half):
                    orow[j] = xr[j] * c[j] - xr[j + half] * s[j]
                    orow[j + half] = xr[j + half] * c[j + half] + xr[j] * s[j + half]


# torch's default CPU generator: a Mersenne Twister (mt19937, as at::mt19937 runs it), its state as get_rng_state lays
# it out: the words left to read + 1 (an int32 at byte 8), the next word's index (a uint64 at 16), 624 words (uint64s)
_N, _M, _STATE_BYTES = 624, 397, 5056
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 624 * 8)


@numba.njit(inline="always")
def _twisted(u, v):
    y = (u & np.uint32(0x80000000)) | (v & np.uint32(0x7FFFFFFF))
    return (y >> np.uint32(1)) ^ (np.uint32(0x9908B0DF) * (y & np.uint32(1)))


@numba.njit(inline="always")
def _temper(y):
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    return y ^ (y >> np.uint32(18))


@numba.njit(inline="always")
def _word(x, j):
    """The raw word 624 after x[j], from x[j], x[j + 1] and x[j + 397] (indices from 0: no wraparound, vectors)."""
    return x[j + _M] ^ _twisted(x[j], x[j + 1])


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _stream(mt, start, out):
    """Write the generator's raw words X[start:start + out.size] into out, X[0:624] being block mt; mt becomes the
    block holding the last word, as torch's twist leaves it; returns torch's new `next`.

    One in-order pass (no prange, not `_JIT`): each word follows from words at least 227 before it, which is what
    lets LLVM vectorize it."""
    w = out.size
    head = np.empty(2 * _N, np.uint32)  # the current block and the next: all words before X[1248]
    head[:_N] = mt
    for j in range(_N):
        head[j + _N] = _word(head, j)
    n = min(w, 2 * _N - start)
    out[:n] = head[start:start + n]
    x = out[_N - start:]  # X[624:], from which the words from X[1248] on follow
    for j in range(w + start - 2 * _N):
        x[j + _N] = _word(x, j)
    end = start + w
    block = (end - 1) // _N
    if block > 1:  # the block before the one that holds the last word drawn, and that block's drawn words, in out
        drawn = end - block * _N
        head[:_N + drawn] = out[(block - 1) * _N - start:end - start]
        for j in range(drawn, _N):
            head[j + _N] = _word(head, j)
    if block > 0:
        mt[:] = head[_N:]
    return end - block * _N


@numba.njit(**_JIT)
def _draws64(out):
    """Turn each uint64 of out, two raw words as _stream left them (first in the low half), into a 64-bit draw in
    place: both tempered, the first the high half."""
    for j in prange(out.size):
        v = out[j]
        first, second = np.uint32(v & np.uint64(0xFFFFFFFF)), np.uint32(v >> np.uint64(32))
        out[j] = (np.uint64(_temper(first)) << np.uint64(32)) | np.uint64(_temper(second))


def _flat(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's flat numpy view (bf16 as the uint16 of its bits)."""
    t = t.detach().reshape(-1)
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def drop(x: torch.Tensor, lanes: torch.Tensor, threshold: int, scale: float, out: torch.Tensor,
         keep: torch.Tensor) -> None:
    """Fill `out` with (`keep` * `x`) * `scale` (fp32, or rounded to bf16) and `keep` with `lanes` >= `threshold`;
    contiguous CPU tensors."""
    _drop(_flat(x), _flat(lanes), threshold, scale, _flat(out), _flat(keep))


def undrop(grad: torch.Tensor, keep: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Fill `out` (fp32) with (`keep` * `grad`) * `scale`; `grad` fp32 or bf16; contiguous CPU tensors."""
    _undrop(_flat(grad), _flat(keep), scale, _flat(out))


def lora_sum(y: torch.Tensor, lo: int, h: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`y`[..., `lo`:`lo` + n] + (`h` * `scale` in h's dtype), summed in fp32, in `dtype` (fp32, or bf16 rounded): y a
    group's frozen output, h one member's LoRA output (n wide); each contiguous, bf16 or fp32."""
    out = torch.empty(h.shape, dtype=dtype)
    if out.numel():
        _sum(_flat(y), y.shape[-1], lo, _flat(h), scale, _flat(out))
    return out


def lora_sum_grad(grad: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`grad`, lora_sum's fp32 output gradient, in bf16 for the frozen matmul's backward; that bf16 times `scale`,
    rounded to bf16, for the LoRA output); `grad` contiguous."""
    frozen, lora = (torch.empty(grad.shape, dtype=torch.bfloat16) for _ in range(2))
    _sum_grad(_flat(grad), scale, _flat(frozen), _flat(lora))
    return frozen, lora


def _strided(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as one flat numpy view from its first to its last (strides >= 0)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return torch.as_strided(t.detach(), (span,), (1,), t.storage_offset()).numpy()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, grad: bool = False) -> None:
    """Fill `out` (fp32, x's shape) with HF's rotary embedding of `x` (batch, heads, seq, dim; fp32, strides >= 0,
    the last 1), or with its gradient where x is the output's gradient (`grad`); `cos` and `sin` (rows, seq, dim)
    contiguous, rows 1 or batch."""
    if x.numel():
        _rope(_strided(x), np.array([*x.stride()[:3], *x.shape], np.int64), _flat(cos), _flat(sin),
              cos.shape[0] * cos.shape[1], _strided(out), np.array(out.stride()[:3], np.int64), grad)


def random_bits(n: int) -> torch.Tensor | None:
    """`n` int64s, the very draws of `torch.empty(n, dtype=torch.int64).random_(-2**63, None)` from torch's default
    CPU generator, left where that leaves it; made in one vectorized pass and tempered on every thread.

    None (torch's kernel is to draw) off the main thread, since the state's read and write-back is not atomic as
    torch's locked kernel is, and for a state laid out otherwise than this torch's."""
    if n == 0:  # torch's kernel leaves a fresh seed's state as it is (no twist, `next` untouched)
        return torch.empty(0, dtype=torch.int64)
    state = torch.get_rng_state()
    if state.numel() != _STATE_BYTES or threading.current_thread() is not threading.main_thread():
        return None
    s = state.numpy()
    left, nxt = int(s[_LEFT].view(np.int32)[0]), int(s[_NEXT].view(np.uint64)[0])
    if left > 1 and nxt + left != _N + 1:  # the block's remaining words, where torch keeps them
        return None
    mt = s[_WORDS].view(np.uint64).astype(np.uint32)
    out = torch.empty(n, dtype=torch.int64)
    draws = _flat(out).view(np.uint64)
    nxt = _stream(mt, _N + 1 - left, draws.view(np.uint32))
    _draws64(draws)
    s[_LEFT], s[_NEXT] = np.array([_N + 1 - nxt], np.int32).view(np.uint8), np.array([nxt], np.uint64).view(np.uint8)
    s[_WORDS] = mt.astype(np.uint64).view(np.uint8)
    torch.set_rng_state(state)
    return out


def warm() -> None:
    """Set numba's thread count to torch's and, in a process's first call, compile (or load) and run every loop once.

    Called at each compiled switch's install, not inside a step. numba's OpenMP start-up resets the shared libgomp's
    thread count, so torch's is put back and the record's `threads` stays true."""
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    torch.set_num_threads(threads)
    if _WARMED:
        return
    x, lanes, keep, back = torch.ones(64), torch.zeros(64, dtype=torch.int16), torch.empty(64, dtype=torch.bool), \
        torch.empty(64)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(64, dtype=dtype)
        drop(x, lanes, 0, 1.0, out, keep)
        undrop(out, keep, 1.0, back)
    halves = (x, x.to(torch.bfloat16))
    for y, h in [(y, h) for y in halves for h in halves]:  # a sum of any two parts to fp32, of bf16 ones to bf16
        lora_sum(y, 32, h[:32], 1.0, torch.float32)
    lora_sum(halves[1], 32, halves[1][:32], 1.0, torch.bfloat16)
    lora_sum_grad(x, 1.0)
    for grad in (False, True):
        rope(x.view(1, 2, 2, 16), x[:32].view(1, 2, 16), x[:32].view(1, 2, 16), back.view(1, 2, 2, 16), grad)
    with torch.random.fork_rng(devices=[]):  # the run's random stream untouched
        random_bits(1)
    _WARMED.append(True)
