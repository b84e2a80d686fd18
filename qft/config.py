"""Validate the whole composed config before anything heavy runs.

Each config group's module owns its own checks; this only calls them in order, so a bad value fails in
milliseconds with one line naming the key, and the depth-dependent checks run again once the model's
depth is known (from its config, before any weight is read).
"""

from __future__ import annotations

from pathlib import Path

from qft import adapter, budget, data, evaluate, logger, offload, quant, train
from qft.errors import QftError

DEVICES = ("auto", "cpu", "cuda")
CONF = str(Path(__file__).resolve().parent.parent / "conf")  # the Hydra config tree: every default lives there


def device(cfg, planning: bool = False) -> str:
    """The device a run uses; `planning` (the memory model sizing a GPU run from any machine) accepts
    device=cuda without one."""
    import torch

    if cfg.device not in DEVICES:
        raise QftError("device", cfg.device, f"allowed: {', '.join(DEVICES)}")
    if cfg.device == "cuda" and not planning and not torch.cuda.is_available():
        raise QftError("device", "cuda", "no CUDA device is visible; use device=cpu or device=auto")
    return ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device


def validate(cfg, depth: int | None = None, planning: bool = False, files: bool = True) -> str:
    """Raise QftError on the first bad value; return the device the run will use. `files=False` (planning a job for
    another machine) leaves out the checks that read local data and benchmark files."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise QftError(missing[0], "???", "required: set it on the command line")
    dev = device(cfg, planning)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise QftError("seed", cfg.seed, "an integer")
    budget.check(cfg.budget)
    quant.check(cfg.quant, depth)
    adapter.check(cfg.adapter, depth)
    data.check(cfg.data, files)
    train.check(cfg.train, dev)
    logger.check(cfg.logger)
    offload.check(cfg.offload)
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


def compose(argv, prog: str):
    """The config a CLI's Hydra overrides compose to, or None once Hydra's error is printed as one line."""
    import sys

    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(CONF, version_base="1.3"):
        try:
            return hydra_compose("config", overrides=list(sys.argv[1:] if argv is None else argv))
        except Exception as e:  # noqa: BLE001 - Hydra's override errors, as one line
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return None
