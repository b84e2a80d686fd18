"""`python -m qft [overrides]`: one fine-tune (or a Hydra multirun) configured from conf/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from qft import launch
from qft.config import CONF, job_keys, one_line
from qft.errors import QftError

# Models and data come from local folders (DESIGN), so qft's processes keep the Hugging Face stack offline. It
# matters at import: on AVX512-BF16 CPUs bitsandbytes fetches a CPU kernel from the Hub then, one qft never calls
# (qft/quant/bnb4.py keeps bitsandbytes' training layout). Set before huggingface_hub is imported, which reads it
# once; an explicit HF_HUB_OFFLINE=0 is left as the user set it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


STARTED: list = []  # set once Hydra hands over: an OSError before that is Hydra's, making the output folder


@hydra.main(config_path=CONF, config_name="config", version_base="1.3")
def main(cfg) -> float | None:
    """Run one fine-tune of composed config `cfg` in Hydra's run folder; returns its validation accuracy (a sweep's
    objective), or None where it did not finish."""
    from qft import model
    from qft.run import run
    from qft.train import freeze_survivors

    STARTED.append(True)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweeping = hc.mode == RunMode.MULTIRUN
    launch.share(run_dir, sys.argv[1:])  # a torchrun launch's other ranks wait for this folder (qft/launch.py)
    if sweeping:
        pin_gpu(hc.job.num, os.environ)
    rec = None
    try:
        if not sweeping and hc.launcher.get("_target_", "").endswith(".DryRunLauncher"):
            raise QftError("hydra/launcher", "dry_run", "prints a sweep's jobs without running them: add --multirun "
                                                        "(-m); a single run trains, without hydra/launcher=dry_run")
        model.check_name(cfg.model, hc.runtime.choices.get("model"))
        rec = run(cfg, run_dir, job_keys(hc))
    except QftError as e:
        print(f"qft: error: {e}", file=sys.stderr)
        if not sweeping:  # in a sweep it is recorded as failed, and the other runs go on
            sys.exit(2)
    except Exception as e:  # noqa: BLE001 - a sweep outlives one run's crash, which its record holds
        if not sweeping:
            raise
        print(f"qft: run {run_dir} failed: {type(e).__name__}: {e}", file=sys.stderr)
    if sweeping:  # after the except clauses, which release a crash's frames
        freeze_survivors()
    if rec is None:
        return None
    if os.environ.get("RANK", "0") != "0":  # a pipeline stage other than the first: rank 0 scores and reports
        return None
    if cfg.sweep.blind:  # a blinded study's lanes: a skipped or finished run shows no score
        print(f"qft: {rec['status']}: scores withheld (sweep.blind), record {run_dir / 'result.json'}")
    else:
        print(f"qft: {rec['status']}: test accuracy {(rec.get('final_accuracy') or {}).get('test')} "
              f"(zero-shot {(rec.get('zero_shot_accuracy') or {}).get('test')}), record {run_dir / 'result.json'}")
    return (rec.get("final_accuracy") or {}).get("val")


def pin_gpu(job_num: int, env) -> str | None:
    """Set CUDA_VISIBLE_DEVICES in `env` so sweep job `job_num` gets its own GPU of the node (round robin); returns
    it, or None where Slurm or the user restricted the GPUs already, or the node has fewer than two."""
    if "CUDA_VISIBLE_DEVICES" in env or "SLURM_JOB_ID" in env:
        return None
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    gpus = [l for l in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
            if l.startswith("GPU ")]
    if len(gpus) < 2:
        return None
    env["CUDA_VISIBLE_DEVICES"] = str(job_num % len(gpus))
    return env["CUDA_VISIBLE_DEVICES"]


def register_plugins() -> None:
    """Register qft's launcher plugin (hydra/launcher=dry_run) with Hydra explicitly: an editable install hides the
    `hydra_plugins` namespace package from Hydra's walk unless the repository root is the working directory."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.qft_dry_run_launcher.dry_run_launcher import DryRunLauncher

    Plugins.instance().register(DryRunLauncher)


def cli() -> None:
    """The `python -m qft` entry point: Hydra's main, with Hydra's own config errors (an unknown option, a typo'd key)
    ending in one line and exit status 2 as a QftError does."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let them reach us instead of Hydra's exit(1)
    register_plugins()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        sys.argv += launch.follow(sys.argv[1:])  # a torchrun rank other than 0: rank 0's run folder
        main()
    except (HydraException, OmegaConfBaseException, QftError) as e:
        print(f"qft: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if STARTED:
            raise
        print(f"qft: error: hydra.run.dir={e.filename!r}: the output folder cannot be created "
              f"({e.strerror or type(e).__name__}); choose a writable one (hydra.run.dir=... or hydra.sweep.dir=...)",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
