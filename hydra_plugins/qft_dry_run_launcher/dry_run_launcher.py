"""`hydra/launcher=dry_run`: what a sweep would ask a Slurm cluster for, and whether each job fits its GPU.

A paper-scale sweep books hundreds of GPU-hours, and a job that does not fit its GPU or fails validation
wastes its slot; this prints the bill first, from any machine and without any weight. Each job's config is
composed exactly as the real launcher composes it (Hydra's `load_sweep_config`, as BasicLauncher and
submitit do), validated and sized by `qft.tools.memory.estimate` (meta device: a config.json or an architecture
preset is all it reads), and printed with the Slurm request of the launcher it stands in for. Nothing runs.

Hydra imports every module under `hydra_plugins` at start-up, so this one imports qft (and torch) only when
a dry run really launches.
"""

from __future__ import annotations

import copy
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict, read_write

GiB = 1024 ** 3
TARGET = "hydra_plugins.qft_dry_run_launcher.dry_run_launcher.DryRunLauncher"

# The dry run's own key, as an untyped node: conf/hydra/launcher/dry_run.yaml lays the real launcher's
# (typed) Slurm config over it, so every `hydra.launcher.*` override of a real launch works on a dry run too.
ConfigStore.instance().store(group="hydra/launcher", name="qft_dry_run", provider="qft",
                             node={"_target_": TARGET, "gpu_memory_gb": 80})


def gpus_per_job(slurm: dict) -> int:
    """GPUs one job books: nodes x (gpus_per_node, else gpus_per_task x tasks_per_node, else a gres count)."""
    nodes = int(slurm.get("nodes") or 1)
    if slurm.get("gpus_per_node"):
        return nodes * int(slurm["gpus_per_node"])
    if slurm.get("gpus_per_task"):
        return nodes * int(slurm["gpus_per_task"]) * int(slurm.get("tasks_per_node") or 1)
    m = re.search(r"gpu(?::[\w.-]+)?:(\d+)", str(slurm.get("gres") or ""))
    return nodes * int(m.group(1)) if m else 0


def resources(slurm: dict) -> str:
    """The sbatch request of one job, in Slurm's words."""
    minutes = int(slurm.get("timeout_min") or 0)
    mem = f"{slurm['mem_gb']}G" if slurm.get("mem_gb") else "-"
    return (f"partition={slurm.get('partition') or '(default)'} nodes={slurm.get('nodes') or 1} "
            f"gpus={gpus_per_job(slurm)} cpus={slurm.get('cpus_per_task') or '-'} mem={mem} "
            f"time={minutes // 60}:{minutes % 60:02d}:00")


def _jobs(n: int) -> str:
    return f"{n} job{'s' if n != 1 else ''}"


class DryRunLauncher(Launcher):
    """Prints one line a job (overrides | Slurm request | estimated peak per GPU and whether it fits), then a
    total, and returns each job's estimate as its return value."""

    def __init__(self, gpu_memory_gb: float = 80, **slurm: Any) -> None:
        self.gpu_memory_gb = float(gpu_memory_gb)
        self.slurm = slurm
        self.config: DictConfig | None = None
        self.hydra_context = None
        self.task_function = None
        self.sweep_dir = self.scratch = ""

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        # The sweeper saves multirun.yaml into hydra.sweep.dir before it calls the launcher; a dry run must not
        # overwrite a real sweep's copy under results/, so the sweeper (this same config object) gets a scratch dir.
        self.sweep_dir = str(config.hydra.sweep.dir)
        self.scratch = tempfile.mkdtemp(prefix="qft-dry-run-")
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = self.scratch

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from qft import config, model, schema
        from qft.tools import memory
        from qft.errors import QftError

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        gpus, hours = gpus_per_job(self.slurm), int(self.slurm.get("timeout_min") or 0) / 60
        budget = self.gpu_memory_gb * GiB
        print(f"qft dry run: {_jobs(len(job_overrides))}, each asking Slurm for {resources(self.slurm)}; "
              f"records under {self.sweep_dir}; memory estimated per GPU against {self.gpu_memory_gb:g} GiB")
        runs, fit, too_big, failed, elsewhere = [], 0, 0, 0, 0
        try:
            for i, overrides in enumerate(job_overrides):
                idx = initial_job_idx + i
                sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(sweep_config):
                    sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
                HydraConfig.instance().set_config(sweep_config)  # ${hydra:...} resolves as in the job itself
                cfg = copy.deepcopy(sweep_config)
                with read_write(cfg), open_dict(cfg):
                    del cfg["hydra"]
                    schema.complete(cfg)  # as the job's run completes it
                result: dict = {"job": idx, "overrides": list(filter_overrides(overrides))}
                try:
                    note = ""
                    config.check_keys(cfg, keys=config.job_keys(sweep_config.hydra))
                    try:
                        est = memory.estimate(cfg, model.resolve(cfg.model, cfg.cache_dir))
                    except QftError as e:  # data or MMLU files that only the cluster has: size the job without them
                        if e.key not in ("data.path", "evaluate.path"):
                            raise
                        est = memory.estimate(cfg, model.resolve(cfg.model, cfg.cache_dir), files=False)
                        note, elsewhere = f" (not on this machine, the job needs it: {e})", elsewhere + 1
                    # the job trains and then scores on its GPU (a pipeline scores on the host)
                    worst = max(est.peak, 0 if est.mode == "pipeline" else est.eval_peak)
                    result.update(peak_bytes=est.peak, eval_peak_bytes=est.eval_peak, fits=worst <= budget)
                    verdict = (f"peak {est.peak / GiB:.3f} GiB per GPU (evaluation {est.eval_peak / GiB:.3f} GiB): "
                               f"{'fits' if result['fits'] else 'DOES NOT FIT'} {self.gpu_memory_gb:g} GiB{note}")
                    fit, too_big = fit + result["fits"], too_big + (not result["fits"])
                except QftError as e:  # what the job itself would stop on (a missing model folder, a bad value)
                    result["error"] = str(e)
                    verdict, failed = f"error: {e}", failed + 1
                print(f"job {idx}: {' '.join(result['overrides'])} | {resources(self.slurm)} | {verdict}", flush=True)
                job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
                runs.append(JobReturn(overrides=list(overrides), cfg=cfg, hydra_cfg=sweep_config,
                                      working_dir=str(job_dir), task_name=str(sweep_config.hydra.job.name),
                                      status=JobStatus.COMPLETED, _return_value=result))
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        n, at_once = len(job_overrides), self.slurm.get("array_parallelism")
        print(f"total: {_jobs(n)}, {n * gpus * hours:g} GPU-hours requested ({n} x {gpus} GPU x {hours:g} h"
              f"{f', at most {at_once} at once' if at_once else ''}); "
              f"{fit} fit {self.gpu_memory_gb:g} GiB, {too_big} do not, {failed} fail validation"
              f"{f'; {elsewhere} read data or benchmark files not on this machine' if elsewhere else ''}", flush=True)
        return runs
