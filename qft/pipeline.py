"""Pipeline-parallel QLoRA: the decoder cut into contiguous stages, one process (and device) each.

    torchrun --nproc-per-node 2 -m qft offload=pipeline offload.stages=2 [offload.schedule=gpipe]

Each process builds the same adapted model, keeps its stage's layers (qft.planning.stages.plan) and trains them with
qft.train's loop, supplying only the forward-backward (torch.distributed.pipelining); rank 0 gathers the adapter and
scores. Dropout masks depend on the stage layout (docs/memory.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from qft import offload
from qft import train as loop
from qft.launch import world
from qft.planning import measure
from qft.errors import QftError
from qft.model import autocast
from qft.planning.stages import Plan


# --------------------------------------------------------------------------- processes

def init(cfg, device: torch.device) -> torch.device:
    """Join the process group torchrun set up (gloo, or NCCL on a CUDA `device`); returns this rank's device.

    Raises QftError (offload.stages) where the process count is not `cfg.offload.stages`."""
    import torch.distributed as dist

    rank, size = world()
    if size != cfg.offload.stages:
        raise QftError("offload.stages", cfg.offload.stages,
                       f"launch one process per stage: torchrun --nproc-per-node {cfg.offload.stages} -m qft ... "
                       f"(this run has {size})")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


class Stage(nn.Module):
    """Layers [`lo`, `hi`) of LLaMA-family decoder `base`, plus the embedding (`first`) or norm + head (`last`),
    computing under autocast in `dtype`, with activation offload `hooks` where given."""

    def __init__(self, base, lo: int, hi: int, first: bool, last: bool, dtype: torch.dtype, hooks=None):
        super().__init__()
        inner = base.model
        self.config = inner.config
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, base.lm_head) if last else (None, None)
        self.dtype, self.hooks = dtype, hooks
        self.keep = 1  # logits at the last `keep` positions only (set per step)

    def forward(self, x, attention_mask):
        from transformers.masking_utils import create_causal_mask

        dev = attention_mask.device
        with autocast(dev, self.dtype), (self.hooks or contextlib.nullcontext()):
            h = self.embed(x) if self.embed is not None else x
            pos = (attention_mask.cumsum(1) - 1).clamp(min=0)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                      cache=None, position_ids=pos)
            rope = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
            if self.head is None:
                return h
            return self.head(self.norm(h)[:, -self.keep:, :])[:, :-1]


def stage_of(net, the_plan: Plan, rank: int, dtype, device, offloaded: bool, the_route: str = "host") -> Stage:
    """The Stage of `rank` under `the_plan`, computing in `dtype` on `device`, its activations `offloaded` by
    `the_route`; `net` drops other ranks' layers except on rank 0, which keeps the whole model to score it."""
    base = net.get_base_model()
    lo, hi = the_plan.layers[rank]
    p = len(the_plan.layers)
    via = offload.neighbour(device) if offloaded and the_route == "neighbour" else None
    hooks = offload.ActivationOffload(pin_memory=device.type == "cuda", via=via) if offloaded else None
    stage = Stage(base, lo, hi, rank == 0, rank == p - 1, dtype, hooks)
    if rank != 0:
        for i, layer in enumerate(base.model.layers):
            if not lo <= i < hi:
                base.model.layers[i] = nn.Module()  # keeps the names (and so the adapter keys) of the rest
    return stage.to(device)


def _global_clip(params, max_norm: float, group=None) -> float:
    """Clip the gradients of `params` to `max_norm` by the norm over every stage's (all-reduced over `group`): the
    norm of one model, not of each piece; returns it."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum().cpu()
    dist.all_reduce(sq, group=group)
    total = sq.sqrt().item()
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def train(net, task, cfg, the_plan: Plan, dtype, pad_id: int, job, device: torch.device):
    """Train this rank's stage of `net` on `task` by qft.train.train (train group `cfg.train`, one checkpoint folder
    a stage); returns (history, stage, every stage's measured memory).

    `the_plan`: the stages; `dtype`, `pad_id`, `device`: as one process's; `job`: the run's qft.train.Job, without
    `evaluate` (the weights are spread) and tracked on rank 0 only. Raises QftError (train.resume) where the stages'
    checkpoints are at different steps."""
    import torch.distributed as dist

    rank, p = world()
    ocfg = cfg.offload
    stage = stage_of(net, the_plan, rank, dtype, device, rank in the_plan.offloaded, ocfg.route)
    measured, first = {}, []

    def around(done: int, run, opt):
        if not first:  # stages resumed from their own checkpoints must be at one step
            everyone = [None] * p
            dist.all_gather_object(everyone, done)
            first.append(done)
            if len(set(everyone)) > 1:
                raise QftError("train.resume", cfg.train.resume, f"the stages' checkpoints are at steps {everyone}; "
                                                                 "use a fresh run directory")
        if done == 1 or cfg.train.steps == 1:  # measured once, when the optimizer states exist
            out = {}
            peak = measure.measure_peak(lambda: out.update(r=run()), device)
            total, tokens = out["r"]
            measured.update(resident=measure.tensor_bytes(stage, opt), step_peak=peak)
        else:
            total, tokens = run()
        total = torch.tensor([total], dtype=torch.float64)
        dist.broadcast(total, src=p - 1)  # every stage learns the loss (and stops together on NaN)
        return total.item(), tokens

    step = loop.Step(stage, net.get_base_model(), forward_backward(stage, task, ocfg, dtype, pad_id, device),
                     around=around, clip=_global_clip, checkpoint=f"checkpoint/stage-{rank}",
                     label=f"train stage {rank}", progress=rank == p - 1)
    job = dataclasses.replace(job, evaluate=None, track=job.track if rank == 0 else None)
    history = loop.train(task, cfg.train, job, step)
    everyone = [None] * p
    dist.all_gather_object(everyone, {**measured, "layers": the_plan.layers[rank], "device": str(device)})
    return history, stage, everyone


def forward_backward(stage: Stage, task, ocfg, dtype, pad_id: int, device: torch.device):
    """The Step.forward_backward of `stage` on `device`: one micro-batch of `task`'s train split (padded with
    `pad_id`, autocast in `dtype`) through the schedule `ocfg.schedule` in `ocfg.micro_batches`; the last stage
    returns the loss, the others 0."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from qft.data import batch

    rank, p = world()
    schedule_cls = Schedule1F1B if ocfg.schedule == "1f1b" else ScheduleGPipe
    split = task.splits["train"]
    hidden = stage.config.hidden_size

    def run(idx, n_answer):
        prompts, answers = [split.prompts[i] for i in idx], [split.answers[i] for i in idx]
        ids, mask, _ = batch([a + b for a, b in zip(prompts, answers)], pad_id)
        k = max(map(len, answers))
        lengths = torch.tensor([len(a) for a in answers])
        target = ids[:, -k:].clone()
        target[torch.arange(k)[None, :] < (k - lengths)[:, None]] = -100
        stage.keep = k + 1
        mb = ids.shape[0] // ocfg.micro_batches
        width = ids.shape[1]

        def loss_fn(logits, tgt):
            return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                               ignore_index=-100, reduction="sum") / n_answer

        # shapes change with every batch's longest sequence, so each micro-batch describes its own stage I/O
        h_meta = torch.empty(mb, width, hidden, device="meta", requires_grad=True)
        example = torch.empty(mb, width, dtype=torch.long, device="meta") if rank == 0 else h_meta
        out_example = h_meta if rank < p - 1 else \
            torch.empty(mb, k, stage.head.out_features, dtype=dtype, device="meta", requires_grad=True)
        pipe = PipelineStage(stage, rank, p, device, input_args=(example,), output_args=(out_example,))
        schedule = schedule_cls(pipe, n_microbatches=ocfg.micro_batches, loss_fn=loss_fn)
        kwargs = {"attention_mask": mask.to(device)}
        losses = []
        if rank == 0:
            schedule.step(ids.to(device), **kwargs)
        elif rank == p - 1:
            schedule.step(target=target.to(device), losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.step(**kwargs)
        return sum(float(x) for x in losses) * n_answer if rank == p - 1 else 0.0, int(mask.sum())

    return run


def gather(net, stage: Stage, run_dir: Path) -> None:
    """Copy every `stage`'s trained adapter weights into rank 0's whole `net`, through files under `run_dir`."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    rank, p = world()
    folder = run_dir / "pipeline"
    folder.mkdir(parents=True, exist_ok=True)
    names = {id(q): n for n, q in net.named_parameters()}
    if rank != 0:
        save_file({names[id(q)]: q.detach().cpu().contiguous() for q in stage.parameters() if q.requires_grad},
                  str(folder / f"stage-{rank}.safetensors"))
    dist.barrier()
    if rank == 0:
        params = dict(net.named_parameters())
        with torch.no_grad():
            for s in range(1, p):
                for n, t in load_file(str(folder / f"stage-{s}.safetensors")).items():
                    params[n].copy_(t)
        for s in range(1, p):
            (folder / f"stage-{s}.safetensors").unlink()
        folder.rmdir()
