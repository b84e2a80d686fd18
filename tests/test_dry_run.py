"""hydra/launcher=dry_run: a paper-scale sweep's jobs, Slurm request and per-GPU memory, without running or writing."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qft.tools import memory
from conftest import make_cfg
from test_evaluate_mmlu import mmlu_folder

ROOT = Path(__file__).resolve().parent.parent
JOB = re.compile(r"^job (\d+): (.*) \| (partition=.*) \| (.*)$")
PAPER = ["+experiment=rank_sweep", "scale=paper"]


def snapshot(folder: Path) -> dict:
    """The names in `folder` and every file's mtime under its rank_sweep* folders, the only ones this sweep could
    write: a sweep of another experiment running beside the suite (or in another pytest-xdist worker) leaves it
    unchanged."""
    if not folder.exists():
        return {}
    got = {"names": sorted(p.name for p in folder.iterdir())}
    for p in (p for top in folder.glob("rank_sweep*") for p in top.rglob("*")):
        try:
            got[str(p)] = p.stat().st_mtime_ns
        except FileNotFoundError:  # a temporary file renamed away between listing and stat
            pass
    return got


@pytest.fixture
def paper_env(tmp_path, monkeypatch):
    """The two local files scale=paper validates (instruction data, the MMLU folder); no model weights."""
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps([{"instruction": "Say hi.", "input": "", "output": "hi"}] * 4))
    monkeypatch.setenv("QFT_PAPER_DATA", str(data))
    monkeypatch.setenv("QFT_MMLU_DIR", str(mmlu_folder(tmp_path / "mmlu")))
    monkeypatch.delenv("QFT_SWEEP_ROOT", raising=False)
    return tmp_path


def dry_run(tmp_path, *overrides, env=None):
    return subprocess.run([sys.executable, "-m", "qft", *PAPER, "hydra/launcher=dry_run", *overrides,
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=env or os.environ.copy(),
                          capture_output=True, text=True, timeout=600)


def test_dry_run_lists_every_job_with_its_slurm_request_and_the_memory_models_peak(paper_env):
    tmp_path = paper_env
    results = snapshot(ROOT / "results")
    res = dry_run(tmp_path, "model=llama2_7b")  # run from outside the repository: the plugin must still be found
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = [JOB.match(l) for l in res.stdout.splitlines() if l.startswith("job ")]
    assert jobs and all(jobs)

    # one job per grid point of scale=paper's grid (attention rank x MLP rank)
    grid = make_cfg(*PAPER, "model=llama2_7b", tiny=False).grid.rank.split(",")
    assert len(grid) == 4 and len(jobs) == len(grid) ** 2
    assert [int(m.group(1)) for m in jobs] == list(range(len(jobs)))
    points = set()
    for m in jobs:
        overrides = m.group(2).split()
        ranks = {o.split("=")[0]: o.split("=")[1] for o in overrides if o.startswith("adapter.")}
        points.add((ranks["adapter.attn.r"], ranks["adapter.mlp.r"]))
        # the Slurm request is slurm_gpu's: one GPU, 8 CPUs, 64 GB, 4 hours
        assert m.group(3) == "partition=(default) nodes=1 gpus=1 cpus=8 mem=64G time=4:00:00"
        # the peak is qft.tools.memory's for exactly this job's config, composed from its override string
        est = memory.estimate(make_cfg(*overrides, tiny=False))
        assert est.device == "cuda" and est.model == "llama2_7b"
        peak = re.match(r"peak (\d+\.\d+) GiB per GPU \(evaluation (\d+\.\d+) GiB\): (fits|DOES NOT FIT) 80 GiB",
                        m.group(4))
        assert peak, m.group(4)
        assert float(peak.group(1)) == round(est.peak / memory.GiB, 3)
        assert float(peak.group(2)) == round(est.eval_peak / memory.GiB, 3)
        assert (peak.group(3) == "fits") == (max(est.peak, est.eval_peak) <= 80 * memory.GiB)
    assert points == {(a, b) for a in grid for b in grid}
    assert "total: 16 jobs, 64 GPU-hours requested (16 x 1 GPU x 4 h, at most 32 at once)" in res.stdout

    # nothing written: not the records' folder, not even the sweeper's multirun.yaml
    assert snapshot(ROOT / "results") == results
    assert not (tmp_path / "sweep").exists()


def test_dry_run_takes_the_real_launchers_overrides_and_a_gpu_size(paper_env):
    res = dry_run(paper_env, "model=llama2_7b", "grid.rank='0,64'", "train.eval_batch_size=2",
                  "hydra.launcher.partition=a100", "hydra.launcher.timeout_min=90", "hydra.launcher.gpu_memory_gb=12.5")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [l for l in res.stdout.splitlines() if l.startswith("job ")]
    assert len(lines) == 4 and all("| partition=a100 nodes=1 gpus=1 cpus=8 mem=64G time=1:30:00 |" in l for l in lines)
    # rank 0 everywhere trains nothing (about 4.1 GiB) and fits 12.5 GiB; rank 64 everywhere (about 13.3) does not
    assert "fits 12.5 GiB" in lines[0] and "DOES NOT FIT 12.5 GiB" in lines[-1]
    assert "total: 4 jobs, 6 GPU-hours requested (4 x 1 GPU x 1.5 h" in res.stdout


def test_a_missing_model_folder_is_that_jobs_error_not_a_crash(paper_env):
    env = {**os.environ, "QFT_PAPER_MODEL": str(paper_env / "no-such-model")}
    res = dry_run(paper_env, "grid.rank=4", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    [line] = [l for l in res.stdout.splitlines() if l.startswith("job ")]
    assert line.endswith(f"| error: model.path='{paper_env / 'no-such-model'}': must be a Hugging Face model folder "
                         f"with config.json, or a .gguf file")
    assert "0 fit 80 GiB, 0 do not, 1 fail validation" in res.stdout


def test_a_key_the_chosen_presets_lack_is_that_jobs_error(paper_env):
    """The dry run refuses what the job would: here a seed for a model read from a folder (model=llama2_7b is an
    architecture preset, which has one; paper_7b does not)."""
    res = dry_run(paper_env, "grid.rank=4", "+model.seed=5")
    assert res.returncode == 0, res.stderr[-3000:]
    [line] = [l for l in res.stdout.splitlines() if l.startswith("job ")]
    assert line.endswith("| error: model.seed=5: not a key of the chosen presets; it is one of model=tiny_llama")
