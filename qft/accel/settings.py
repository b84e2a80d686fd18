"""The eight speed switches, read in one place: they change no number, so none enters the config hash."""

from __future__ import annotations

# what each reads and its value where the config leaves it out
_TRAIN = {"host_allocator": "default", "fuse_projections": False, "compiled_masks": False, "compiled_sums": False,
          "compiled_rope": False, "split_rows": False}
_QUANT = {"cache_quantized": True, "cache_dequantized": False}
NAMES = (*_TRAIN, *_QUANT)
# the switches installed on a built model, as the record's `execution` names them: all CPU code
MODEL_SWITCHES = ("fuse_projections", "compiled_masks", "compiled_sums", "compiled_rope", "split_rows")


def switches(cfg) -> dict:
    """{switch: setting} for a whole run config: `host_allocator` a name (tuned | default), the others booleans.

    Keys are the switches' short names (train.* and quant.*); a config without one gets the value a run has always
    given it."""
    return {**{k: read(cfg.train, k) for k in _TRAIN}, **{k: read(cfg.quant, k) for k in _QUANT}}


def read(group, name: str):
    """One switch from its config group (cfg.train, cfg.quant), for code handed only the group."""
    value = group.get(name, {**_TRAIN, **_QUANT}[name])
    return value if name == "host_allocator" else bool(value)


def on_device(cfg, device: str) -> dict[str, bool]:
    """{switch: asked for and applies} for MODEL_SWITCHES on a device type ("cpu", "cuda"): the compiled loops are
    CPU code, and fusion has not been shown to change no number on CUDA (scripts/gpu_check.py compares it there),
    so none applies off the CPU. What `install` installs at most, and what the memory model plans."""
    on = switches(cfg)
    return {k: on[k] and device == "cpu" for k in MODEL_SWITCHES}
