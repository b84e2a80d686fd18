"""4-bit NF4/FP4 through bitsandbytes (`Linear4bit`), and the same weights held dequantized (`Dequantized`)."""

from __future__ import annotations

import torch
from torch import nn

from qft.quant.registry import Backend, register


def _bytes(q: nn.Module) -> int:
    """The bytes of `q`'s own parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(q.parameters(recurse=False)) + list(q.buffers(recurse=False)))


def linear4bit_bytes(q: nn.Module) -> int:
    """The bytes of 4-bit `q`: the packed codes plus the quantization statistics (absmax, nested absmax, code,
    offset)."""
    total = _bytes(q)
    qs = q.weight.quant_state
    for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
        total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    if qs.state2 is not None:
        total += sum(t.numel() * t.element_size() for t in (qs.state2.absmax, qs.state2.code))
    return total


class Dequantized(nn.Linear):
    """A frozen 4-bit projection `q` dequantized once into the compute dtype: the same values, still the QLoRA model.

    bitsandbytes dequantizes in every forward and backward; the frozen weight never changes, so once gives the same
    numbers without that cost, at 2 bytes a weight instead of about 0.5."""

    def __init__(self, q: nn.Module):
        import bitsandbytes.functional as bf

        w = q.weight
        nn.Module.__init__(self)  # not nn.Linear's: its random init would shift the seeded LoRA init
        self.in_features, self.out_features = q.in_features, q.out_features
        self.weight = nn.Parameter(bf.dequantize_4bit(w.data, w.quant_state).to(q.compute_dtype),
                                   requires_grad=False)
        self.bias = None if q.bias is None else nn.Parameter(q.bias.data.to(q.compute_dtype), requires_grad=False)
        self.quant_type = w.quant_type
        self.quantized_bytes = linear4bit_bytes(q)  # what the frozen base is, for records and memory plans

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def dequantize_as_gemm(w, dtype: torch.dtype) -> torch.Tensor:
    """4-bit weight `w` in `dtype`, computed as bitsandbytes' own 4-bit matmul computes it (gemm_4bit on CPU)."""
    qs = w.quant_state
    absmax = qs.absmax
    if qs.nested:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(qs.absmax, qs.state2.absmax, qs.state2.code,
                                                                      256, torch.float32) + qs.offset
    return torch.ops.bitsandbytes.dequantize_4bit.default(w.data.view(-1, 1), absmax, qs.blocksize, qs.quant_type,
                                                          qs.shape, dtype)


class FourBit(Backend):
    """4-bit NF4 or FP4 (`Linear4bit`, double quantization and block size from the settings), or Dequantized."""

    name, bits, quant_types = "bnb4", 4, ("nf4", "fp4")
    output_in_input_dtype = True  # bitsandbytes returns its input's dtype; so does Dequantized
    holds_dequantized = True
    fuses = True

    @property
    def modules(self):
        import bitsandbytes as bnb

        return (bnb.nn.Linear4bit, Dequantized)

    def quantize(self, linear, s, compute_dtype, device):
        import bitsandbytes as bnb

        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=s["double_quant"],
                              quant_type=s["quant_type"], quant_storage=torch.uint8)
        q.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type=s["quant_type"],
                                     compress_statistics=s["double_quant"], blocksize=s["block_size"])
        # On AVX512-BF16 CPUs bitsandbytes repacks the weight in place at the first no-grad forward, so
        # evaluation would change the tensors training then runs on; one layout keeps eval and train alike.
        q.support_avx512bf16_for_cpu = False
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.float(), requires_grad=False)
        return q.to(device)  # bitsandbytes quantizes on the move to a device

    def tensors(self, q):
        out = super().tensors(q)
        if isinstance(q, Dequantized):
            out["quantized_bytes"] = torch.tensor([q.quantized_bytes])
        else:
            out.update({f"qs.{k}": v for k, v in q.weight.quant_state.as_dict(packed=True).items()})
        return out

    def rebuild(self, t, s, in_f, out_f, compute_dtype, device, at):
        import bitsandbytes as bnb

        bias = "bias" in t
        if "quantized_bytes" in t:
            if at is None:
                nn.Linear(in_f, out_f, bias=bias)  # the draws of the Linear4bit the dequantized copy came from
            q = Dequantized.__new__(Dequantized)
            nn.Module.__init__(q)
            q.in_features, q.out_features, q.quant_type = in_f, out_f, s["quant_type"]
            q.quantized_bytes = int(t["quantized_bytes"].item())
            q.weight = nn.Parameter(t["weight"], requires_grad=False)
            q.bias = nn.Parameter(t["bias"], requires_grad=False) if bias else None
            return q.to(device)
        q = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=compute_dtype,
                              compress_statistics=s["double_quant"], quant_type=s["quant_type"],
                              quant_storage=torch.uint8, device=at)
        stats = {k[3:]: v for k, v in t.items() if k.startswith("qs.")}
        q.weight = bnb.nn.Params4bit.from_prequantized(t["weight"], stats, requires_grad=False, device=device,
                                                       module=q)
        q.support_avx512bf16_for_cpu = False
        if bias:
            q.bias = nn.Parameter(t["bias"].to(device), requires_grad=False)
        return q

    def dequantized(self, q):
        return Dequantized(q)

    def weight(self, q):
        if isinstance(q, Dequantized):
            return q.weight.data.float()
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(q.weight.data, q.weight.quant_state).float()

    def describe(self, q):
        return q.quant_type if isinstance(q, Dequantized) else q.weight.quant_type

    def format(self, s, compute_dtype):
        return s["quant_type"]

    def module_bytes(self, q):
        return q.quantized_bytes if isinstance(q, Dequantized) else linear4bit_bytes(q)

    def weight_bytes(self, s, in_f, out_f, compute_bytes, bias):
        """Two weights a byte, an fp32 absmax per block, the 16-entry fp32 code; with double quantization the
        absmax is itself 8-bit with an fp32 offset, an fp32 absmax per 256 blocks and a 256-entry code."""
        n = in_f * out_f
        blocks = -(-n // s["block_size"])
        stats = blocks + 4 + (-(-blocks // 256)) * 4 + 256 * 4 if s["double_quant"] else blocks * 4
        return (n + 1) // 2 + stats + 16 * 4 + (out_f * 4 if bias else 0)

    def work_bytes(self, n, compute_bytes, device):
        """Forward: dequantized to fp32, then to the compute dtype; backward: the fp32 weight for the input's
        gradient."""
        return n * (4 + (compute_bytes if compute_bytes < 4 else 0)), 4 * n

    def fuse_kind(self, q):
        return "stored" if isinstance(q, Dequantized) else "computed"

    def compute_dtype(self, q):
        return q.weight.dtype if isinstance(q, Dequantized) else q.compute_dtype

    def fusable(self, q, device):
        """On CUDA bitsandbytes has a 4-bit matmul kernel of its own; on the CPU it dequantizes as
        `dequantize_as_gemm` does, unless it repacked the weight for its AVX512 kernel."""
        return (device.type == "cpu" and q.weight.device == device
                and not getattr(q.weight.quant_state, "packing_format_for_cpu", False))

    def fused_weight(self, q, dtype):
        return dequantize_as_gemm(q.weight, dtype)


register(FourBit())
