"""The config's home: where the Hydra tree lives, how a CLI composes it, and which device it names.

It imports no config group's module, so every module (the group modules' own CLIs included) can import it;
checking the whole config is qft.validate's.
"""

from __future__ import annotations

from pathlib import Path

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
