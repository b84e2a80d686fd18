"""Named servers and model shapes, so a question about a known setup needs no measured per-stage numbers."""

from __future__ import annotations

from dataclasses import dataclass

from qft.errors import QftError, integer, number, one_of
from qft.tools.simulate.inputs import GB, GiB, Server, Stage, Workload


def _rtx3090(n):
    # 24 GiB GDDR6X; PCIe 4.0 x16: 31.5 GB/s raw, ~25 GB/s measured pinned copies; NVLink bridge: 4 links,
    # 112.5 GB/s total, 56.25 GB/s per direction (NVIDIA spec), bridges join GPUs in pairs.
    return Server(n_gpus=n, gpu_memory_bytes=24 * GiB, pcie_bandwidth=25 * GB,
                  nvlink_pairs=tuple((i, i + 1) for i in range(0, n, 2)), nvlink_bandwidth=56 * GB,
                  name=f"rtx3090x{n}")


SERVERS = {"rtx3090x4": lambda: _rtx3090(4), "rtx3090x8": lambda: _rtx3090(8)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int


MODELS = {
    "llama2-7b": ModelShape("LLaMA-2-7B", 32, 4096, 32, 11008, 32000),
    "llama2-13b": ModelShape("LLaMA-2-13B", 40, 5120, 40, 13824, 32000),
}


def workload_from_model(model: str | ModelShape, stages: int, micro_batches: int, micro_batch_size: int = 1,
                        seq_len: int = 2048, schedule: str = "1f1b", tflops: float = 30e12,
                        bwd_ratio: float = 2.0, lora_rank: int = 16, flash_attention: bool = False,
                        base_bytes_per_param: float = 0.5 + 0.127 / 8, overhead_bytes: float = 1.0 * GiB
                        ) -> Workload:
    """The Workload of LLaMA-shaped `model` (NF4 base, LoRA of `lora_rank` on all projections) in `stages` stages
    under `schedule`, `micro_batches` of `micro_batch_size` sequences of `seq_len`.

    Forward FLOPs 2 * params * tokens + 4 b s^2 h a layer at `tflops`, backward `bwd_ratio` x forward; activations
    s b h (34 + 5 a s / h) bytes a layer (Korthikanti et al. 2022; 5as/h dropped with `flash_attention`); the base
    at `base_bytes_per_param`, LoRA at 16 B/param, plus `overhead_bytes` a GPU; the logits are the last stage's."""
    if isinstance(model, str):
        one_of("model", model, MODELS)
        model = MODELS[model]
    integer("stages", stages, low=1)
    if stages > model.layers:
        raise QftError("stages", stages, f"at most {model.layers} (the layers of {model.name})")
    integer("micro_batch_size", micro_batch_size, low=1)
    integer("seq_len", seq_len, low=1)
    number("tflops", tflops, above=0)
    number("bwd_ratio", bwd_ratio, above=0)
    integer("lora_rank", lora_rank, low=0)
    L, h, a, f, V = model.layers, model.hidden, model.heads, model.ffn, model.vocab
    b, s = micro_batch_size, seq_len
    tokens = b * s
    per_layer_params = 4 * h * h + 3 * h * f
    lora_params = lora_rank * (4 * 2 * h + 2 * (h + f) + (f + h))
    act_layer = s * b * h * (34 + (0 if flash_attention else 5 * a * s / h))
    fwd_layer = 2 * per_layer_params * tokens + 4 * b * s * s * h
    out = []
    for st in range(stages):
        n = L // stages + (1 if st >= stages - L % stages else 0)
        fwd = n * fwd_layer
        act = n * act_layer
        fixed = n * (per_layer_params * base_bytes_per_param + lora_params * 16) + overhead_bytes
        if st == 0:
            fixed += 2 * V * h  # embedding, bf16
        if st == stages - 1:
            fwd += 2 * tokens * h * V
            act += tokens * V * 4  # fp32 logits kept for the loss backward
            fixed += 2 * V * h  # head, bf16
        out.append(Stage(fwd_s=fwd / tflops, bwd_s=bwd_ratio * fwd / tflops, act_bytes=act, fixed_bytes=fixed,
                         boundary_bytes=2 * tokens * h))
    return Workload(stages=tuple(out), micro_batches=micro_batches, schedule=schedule,
                    tokens_per_step=tokens * micro_batches,
                    name=f"{model.name} NF4, b={b} s={s} m={micro_batches}, {stages} stages, {schedule}")
