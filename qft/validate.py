"""Validate the whole composed config before anything heavy runs.

Each config group's module owns its checks; this calls them in order, so a bad value fails at once with one line
naming the key. The depth checks run again once the model's depth is known, before any weight is read.
"""

from __future__ import annotations

from qft import adapter, budget, data, evaluate, logger, model, offload, quant, schema, train
from qft.config import check_keys, device
from qft.errors import QftError


def validate(cfg, depth: int | None = None, planning: bool = False, files: bool = True, keys=None) -> str:
    """Check the composed config `cfg`; returns the device the run uses, or raises QftError on the first bad value.

    `depth`: the model's layer count where known (depth groups); `planning`: device=cuda accepted without one;
    `files=False` (planning for another machine): local data and benchmark files not read; `keys`: the chosen
    presets' keys (qft.config.chosen)."""
    from omegaconf import OmegaConf

    check_keys(cfg, keys=keys)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise QftError(missing[0], "???", "required: set it on the command line")
    schema.check(cfg, "", only=("cache_dir", "seed"))
    schema.check(cfg.sweep, "sweep")
    dev = device(cfg, planning)
    model.check(cfg.model, files)
    budget.check(cfg.budget)
    quant.check(cfg.quant, depth)
    adapter.check(cfg.adapter, depth)
    data.check(cfg.data, files)
    train.check(cfg.train, dev)
    logger.check(cfg.logger)
    offload.check(cfg.offload)
    schema.check(cfg.accel, "accel")
    if files:
        evaluate.check(cfg.get("evaluate"))
    if cfg.quant.compute_dtype == "fp16":
        raise QftError("quant.compute_dtype", "fp16", "fp16 training needs loss scaling, which qft does not do; "
                                                       "use bf16, fp32 or auto")
    if cfg.offload.route == "neighbour" and dev != "cuda":
        raise QftError("offload.route", "neighbour", "needs CUDA GPUs with peer access (an NVLink bridge); use host")
    if cfg.offload.mode == "pipeline" and cfg.train.batch_size % cfg.offload.micro_batches:
        raise QftError("offload.micro_batches", cfg.offload.micro_batches,
                       f"must divide train.batch_size={cfg.train.batch_size}")
    return dev
