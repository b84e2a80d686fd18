"""One run folder for every process of a `torchrun` launch.

Each rank's Hydra names its run folder after the second it started in, so ranks could write to different folders.
Rank 0 publishes its folder in torchrun's key-value store (`share`) and every other rank runs in it as
`hydra.run.dir` (`follow`). A folder named on the command line needs none of this.
"""

from __future__ import annotations

import os
from pathlib import Path

from qft.errors import QftError

# Hydra flags that print and exit without a run: no folder to agree on (rank 0 would never publish one)
NO_RUN = ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "-i", "-sc", "--shell-completion", "-p", "--package")


def world() -> tuple[int, int]:
    """(rank, world size) of this process, from torchrun's environment; (0, 1) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _agrees(argv: list[str]) -> bool:
    """Whether ranks launched with command line `argv` must agree on a run folder through the store."""
    return world()[1] > 1 and not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv) \
        and not set(argv) & {"-m", "--multirun", *NO_RUN}


def _store():
    """A client of torchrun's agent store at MASTER_ADDR:MASTER_PORT."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(minutes=5))


def _key() -> str:
    """The store key of the run folder, per restart of the launch."""
    return f"qft/run_dir/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restarted launch agrees anew


def follow(argv: list[str]) -> list[str]:
    """The Hydra overrides that put this process, launched with `argv`, in rank 0's run folder ([] on rank 0 or
    where nothing must agree). Raises QftError (hydra.run.dir) for several processes without torchrun's store."""
    if not _agrees(argv):
        return []
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise QftError("hydra.run.dir", None, f"{world()[1]} processes started without torchrun's store cannot agree "
                                              "on a run folder: name one, the same on every rank (hydra.run.dir=...)")
    if world()[0] == 0:
        return []
    path = _store().get(_key()).decode()
    return ["hydra.run.dir='" + path.replace("'", "\\'") + "'"]


def share(run_dir: Path, argv: list[str]) -> None:
    """Rank 0's side of follow(): publish `run_dir` in the store where the launch with `argv` must agree."""
    if world()[0] == 0 and _agrees(argv) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _store().set(_key(), str(Path(run_dir).resolve()))
