"""The training loop: answer-only loss, AdamW, warmup + decay, accumulation, clipping, checkpoints, resume.

A plain loop rather than the HF Trainer, because the pipeline offloader and the speed work need to own
each step. Batches are a pure function of (seed, step), and a checkpoint holds the adapter, optimizer,
scheduler and RNG state, so a killed run resumed from its last checkpoint ends at the same weights.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from qft.data import Task, batch
from qft.errors import QftError
from qft import atomic, offload, schema
from qft.model import autocast, device_of



def check(cfg, device: str) -> None:
    """Check the train group `cfg` (qft.schema's declared checks) and what `device` allows; raises QftError naming
    the key (train.optimizer: 8-bit AdamW needs CUDA)."""
    schema.check(cfg, "train")
    if cfg.optimizer != "adamw" and device != "cuda":
        raise QftError("train.optimizer", cfg.optimizer, "8-bit and paged AdamW need CUDA; on CPU use adamw")


def freeze_survivors() -> int:
    """Collect the finished run's reference cycles, then `gc.freeze` what survives; returns the frozen count.

    Called between a sweep's runs in one process, so later full collections skip the imported stack's objects
    (benchmarks/README.md). What survives includes the config Hydra holds for the job just done, never collected.
    Safe because no job runs as a thread beside another (joblib's launcher uses processes; run.run refuses a second
    run in one process)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class History:
    """A run's training history, stored in its checkpoint and record."""

    loss: list = field(default_factory=list)  # [step, mean answer-token loss]
    val_accuracy: list = field(default_factory=list)  # [step, accuracy]
    val_loglik: list = field(default_factory=list)  # [step, mean log-likelihood of the gold label]
    train_tokens: int = 0
    train_seconds: float = 0.0
    completed: bool = False
    step: int = 0
    executions: list = field(default_factory=list)  # what ran each invocation that trained (one more per resume)


def make_optimizer(cfg, params):
    """The optimizer `cfg.optimizer` names (adamw, adamw8bit, paged_adamw8bit) over `params`, with `cfg.lr` and
    `cfg.weight_decay`."""
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    import bitsandbytes as bnb

    return (bnb.optim.AdamW8bit if cfg.optimizer == "adamw8bit" else bnb.optim.PagedAdamW8bit)(params, **kwargs)


def lr_factor(cfg, step: int) -> float:
    """The learning-rate factor at `step`: linear warmup over `cfg.warmup_steps`, then `cfg.schedule` (cosine or
    linear decay to zero at `cfg.steps`, or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress


def micro_batch_indices(n: int, batch_size: int, micro_step: int, seed: int) -> list[int]:
    """The example indices of micro-batch `micro_step` (of `batch_size`, from `n` examples) in a shuffle per epoch
    seeded by `seed`: a pure function, so resume needs no state."""
    bs = min(batch_size, n)
    per_epoch = n // bs
    epoch, j = divmod(micro_step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[j * bs:(j + 1) * bs].tolist()


def answer_loss(model, prompts, answers, pad_id: int, dtype: torch.dtype):
    """(summed cross-entropy over the answer tokens, their count, the batch's non-pad tokens) of `model` on
    `prompts` + `answers` (token id lists), left-padded with `pad_id`, under autocast in `dtype`.

    Left padding ends every answer at the last column, so only the last k+1 positions need logits."""
    dev = device_of(model)
    ids, mask, pos = (t.to(dev) for t in batch([p + a for p, a in zip(prompts, answers)], pad_id))
    k = max(map(len, answers))
    with autocast(dev, dtype):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=k + 1).logits[:, :-1]
    lengths = torch.tensor([len(a) for a in answers], device=dev)
    valid = torch.arange(k, device=dev)[None, :] >= (k - lengths)[:, None]
    loss = torch.nn.functional.cross_entropy(logits.float()[valid], ids[:, -k:][valid], reduction="sum")
    return loss, int(valid.sum()), int(mask.sum())


# --------------------------------------------------------------------------- checkpoints

def save_checkpoint(folder: Path, model, opt, sched, history: History, config_hash: str) -> None:
    """Write `model`'s trainable parameters, the state of `opt` and `sched`, the RNG state and `history` to `folder`,
    tagged with `config_hash`; each file atomically, older steps' files removed after."""
    folder.mkdir(parents=True, exist_ok=True)
    step = history.step
    trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    state = opt.state_dict()
    tensors, scalars = {"rng.torch": torch.get_rng_state()}, {}
    if torch.cuda.is_available():  # dropout on CUDA draws from the CUDA generators
        tensors.update({f"rng.cuda.{i}": t for i, t in enumerate(torch.cuda.get_rng_state_all())})
    for i, st in state["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{i}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{k}"] = v
    atomic.write(folder / f"trainable-{step}.safetensors", lambda p: save_file(trainable, p))
    atomic.write(folder / f"optimizer-{step}.safetensors", lambda p: save_file(tensors, p))
    meta = {"step": step, "config_hash": config_hash, "param_groups": state["param_groups"], "scalars": scalars,
            "scheduler": sched.state_dict(), "history": history.__dict__}
    atomic.write(folder / "meta.json", lambda p: Path(p).write_text(json.dumps(meta)))
    for old in folder.glob("*-*.safetensors"):  # meta.json now points at this step
        if not old.stem.endswith(f"-{step}"):
            old.unlink(missing_ok=True)


def load_checkpoint(folder: Path, model, opt, sched, config_hash: str, strict: bool = True) -> History | None:
    """Restore the checkpoint in `folder` into `model`, `opt`, `sched` and the RNG; returns its History, or None
    where there is none. Raises QftError (train.resume) where it belongs to another `config_hash`, unless `strict`
    is False: then it is ignored (None)."""
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    if meta["config_hash"] != config_hash and not strict:
        print(f"qft: ignoring the checkpoint in {folder}: it belongs to another config", file=sys.stderr)
        return None
    if meta["config_hash"] != config_hash:
        raise QftError("train.resume", True, f"the checkpoint in {folder} belongs to another config "
                                             f"({meta['config_hash'][:12]}); use a fresh run directory")
    step = meta["step"]
    trainable = load_file(folder / f"trainable-{step}.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    tensors = load_file(folder / f"optimizer-{step}.safetensors")
    state: dict = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, i, k = key.split(".", 2)
            state.setdefault(int(i), {})[k] = v
    for key, v in meta["scalars"].items():
        i, k = key.split(".", 1)
        state.setdefault(int(i), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    sched.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(len(tensors)) if f"rng.cuda.{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    return History(**meta["history"])


# --------------------------------------------------------------------------- the loop

def finish_step(history: History, params, opt, sched, mean: float, tokens: int, t0: float, max_grad_norm,
                bar, clip=torch.nn.utils.clip_grad_norm_) -> None:
    """Finish a step after its backward passes: check `mean` (the step's loss), clip `params` to `max_grad_norm`
    with `clip`, step `opt` and `sched`, add the step, `tokens` and time since `t0` to `history`, update `bar`.

    Raises FloatingPointError where the loss or the gradient norm is not finite."""
    if not math.isfinite(mean):
        raise FloatingPointError(f"loss is {mean} at step {history.step + 1}")
    norm = float(clip(params, max_grad_norm or math.inf))  # an infinite bound measures the norm and scales nothing
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm} at step {history.step + 1} (the loss was {mean})")
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    history.step += 1
    history.loss.append([history.step, mean])
    history.train_tokens += tokens
    history.train_seconds += time.perf_counter() - t0
    bar.update(1)
    bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{history.train_tokens / history.train_seconds:.0f}")


@dataclass
class Job:
    """What a training run is recorded as and reports along the way, besides its model, data and train config."""

    run_dir: Path  # the checkpoint lives under it
    config_hash: str  # a checkpoint resumes only into the config that wrote it
    seed: int  # with the step number, picks every micro-batch (micro_batch_indices)
    evaluate: Callable | None = None  # evaluate("val") -> accuracy or (accuracy, mean gold-label log-likelihood)
    track: Callable | None = None  # track(metrics, step) after every step
    execution: dict | None = None  # what ran this invocation: appended to History.executions


@dataclass
class Step:
    """How a step's gradients are made: the one part a pipeline replaces.

    `module`: the trainable parameters stepped and checkpointed; `base`: the transformers model (gradient
    checkpointing goes there); `forward_backward(indices, n_answer)`: one micro-batch forward and backward, its answer
    loss divided by the step's `n_answer` tokens, returning (summed loss, tokens read); `around(step, run, opt)`: runs
    `run() -> (loss, tokens)` for the whole step; `clip(params, bound)`: clips and returns the norm."""

    module: torch.nn.Module
    base: torch.nn.Module
    forward_backward: Callable[[list[int], int], tuple[float, int]]
    around: Callable = lambda step, run, opt: run()
    clip: Callable = torch.nn.utils.clip_grad_norm_
    checkpoint: str = "checkpoint"  # the folder under the run directory
    label: str = "train"  # the progress bar's
    progress: bool = True  # whether this process shows the progress bar


def answer_step(model, task: Task, dtype: torch.dtype, pad_id: int, offload_cfg=None) -> Step:
    """The Step of one process: answer_loss of `model` (compute `dtype`, `pad_id`) over micro-batches of `task`'s
    train split, under activation offload where `offload_cfg` sets it."""
    split = task.splits["train"]

    def forward_backward(idx, n_answer):
        with offload.hooks(offload_cfg, device_of(model)):
            loss, _, seq_tokens = answer_loss(model, [split.prompts[i] for i in idx], [split.answers[i] for i in idx],
                                              pad_id, dtype)
        (loss / n_answer).backward()
        return loss.item(), seq_tokens

    return Step(model, model, forward_backward)


def train(task: Task, cfg, job: Job, step: Step) -> History:
    """Fine-tune the trainable parameters of `step.module` on `task`'s train split; returns the History
    (`completed`: all `cfg.steps` ran). One loop for one process and each pipeline stage.

    `cfg`: the train group (steps, batch_size, grad_accum, schedule, resume, ...); `job`: run directory, config hash,
    seed, and optional `evaluate("val")` (every eval_every steps but the last) and `track(metrics, step)`; `step`: how
    gradients are made (answer_step, or a pipeline stage's). A checkpoint every checkpoint_every steps and where
    stop_after_steps ends the invocation. Raises QftError (train.resume) on another config's checkpoint."""
    params = [p for p in step.module.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    if cfg.gradient_checkpointing:
        step.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = job.run_dir / step.checkpoint
    resumed = load_checkpoint(ckpt, step.module, opt, sched, job.config_hash, strict=cfg.resume is True) \
        if cfg.resume else None
    history = resumed or History()
    if job.execution is not None and history.step < cfg.steps:
        history.executions.append(job.execution)
    split = task.splits["train"]
    n = len(split.prompts)
    step.module.train()
    bar = tqdm(total=cfg.steps, initial=history.step, desc=step.label, dynamic_ncols=True,
               disable=os.environ.get("QFT_PROGRESS", "1") == "0" or not step.progress)
    started_at = history.step
    while history.step < cfg.steps:
        t0 = time.perf_counter()
        micro = [micro_batch_indices(n, cfg.batch_size, history.step * cfg.grad_accum + a, job.seed)
                 for a in range(cfg.grad_accum)]
        n_answer = sum(len(split.answers[i]) for idx in micro for i in idx)

        def accumulate():
            total, tokens = 0.0, 0
            for idx in micro:
                loss, seq_tokens = step.forward_backward(idx, n_answer)
                total += loss
                tokens += seq_tokens
            return total, tokens

        total, tokens = step.around(history.step, accumulate, opt)
        lr = sched.get_last_lr()[0]  # the rate this step used
        finish_step(history, params, opt, sched, total / n_answer, tokens, t0, cfg.max_grad_norm, bar, step.clip)
        mean, tokens_per_s = history.loss[-1][1], history.train_tokens / history.train_seconds
        last = history.step == cfg.steps
        metrics = {"train/loss": mean, "train/lr": lr, "train/tokens_per_s": tokens_per_s}
        if job.evaluate and cfg.eval_every and history.step % cfg.eval_every == 0 and not last:
            scored = job.evaluate("val")
            acc, loglik = scored if isinstance(scored, tuple) else (scored, None)
            history.val_accuracy.append([history.step, acc])
            metrics["val/accuracy"] = acc
            if loglik is not None:
                history.val_loglik.append([history.step, loglik])
                metrics["val/gold_loglik"] = loglik
        if job.track:
            job.track(metrics, history.step)
        stop = cfg.stop_after_steps and history.step - started_at >= cfg.stop_after_steps and not last
        if stop or (cfg.checkpoint_every and history.step % cfg.checkpoint_every == 0 and not last):
            save_checkpoint(ckpt, step.module, opt, sched, history, job.config_hash)
        if stop:
            break
    bar.close()
    history.completed = history.step == cfg.steps
    return history
