import os
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from qft import model, run, schema
from qft.config import CONF

# `make test` spreads the suite over pytest-xdist workers, one per core: each computes on one thread (its runs'
# subprocesses too, through the environment), since two workers each spinning two OpenMP threads on two cores slow
# each other down
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
CACHE = os.environ.setdefault("QFT_CACHE", str(Path("~/.cache/qft").expanduser()))
os.environ.setdefault("QFT_PROGRESS", "0")
TINY_DATA = ["data.train_size=48", "data.val_size=10", "data.test_size=15"]


def spread_lora_b(net) -> None:
    """A trained-looking adapter (B is zero at init), each B drawn from a generator seeded by its name, so two models
    built alike get the same B whatever else consumed the global random stream."""
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))


def write_test_examples(folder: Path, correct) -> None:
    """`folder`/examples.npz as run.run keeps a final test evaluation, from per-example correctness `correct` (0/1):
    ids 0..n-1 (as strings), gold 0 and the prediction right or wrong by `correct`."""
    import numpy as np

    n = len(correct)
    np.savez(folder / "examples.npz", **{"final.test.index": np.arange(n), "final.test.id": np.arange(n).astype(str),
                                         "final.test.gold": np.zeros(n, int), "final.test.pred": 1 - correct,
                                         "final.test.correct": np.asarray(correct).astype(bool)})


def make_cfg(*overrides, tiny=True):
    """The config as a run reads it: composed, then completed (qft.schema.complete)."""
    with initialize_config_dir(CONF, version_base="1.3"):
        return schema.complete(compose("config", overrides=(["model=tiny_llama", "device=cpu"] if tiny else [])
                                       + list(overrides)))


def build(*overrides):
    """The tiny quantized, adapter-wrapped model of a config, as a run builds it."""
    cfg = make_cfg(*overrides)
    source = model.resolve(cfg.model, cfg.cache_dir)
    return cfg, source, run.build(cfg, source, torch.device("cpu"))


@pytest.fixture(scope="session")
def tokenizer():
    cfg = make_cfg()
    return model.load_tokenizer(model.resolve(cfg.model, cfg.cache_dir))
