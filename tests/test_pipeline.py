"""Pipeline-parallel QLoRA on CPU (gloo): the same loss curve and adapter as one process; a planner that
balances peak memory, not parameters; budgets that cannot fit are refused with the smallest that does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qft.planning import stages
from qft.errors import QftError
from qft.frame import run_kind

ROOT = Path(__file__).resolve().parent.parent
RUN = ["model=tiny_llama", "device=cpu", "quant.compute_dtype=fp32", "adapter.dropout=0.0",
       "data.train_size=48", "data.val_size=10", "data.test_size=15", "train.steps=3", "train.batch_size=8",
       "train.warmup_steps=1", "train.eval_every=0", "train.checkpoint_every=0", "train.zero_shot=false"]


def qft(tmp: Path, name: str, *args, stages: int = 1):
    env = {**os.environ, "QFT_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    # --standalone: torchrun picks a free port, so pipelines in parallel pytest-xdist workers never meet
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages)
              ] if stages > 1 else [sys.executable]
    res = subprocess.run([*launch, "-m", "qft", *RUN, *args, f"hydra.run.dir={tmp / name}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp / name / "result.json").read_text())
    return rec, load_file(str(tmp / name / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return qft(tmp_path_factory.mktemp("pipe"), "single")


# each schedule once and each stage role (first, middle, last) once: 2-stage GPipe, 3-stage 1F1B (the other two
# pairs cost 28 s of the suite and reach no code these two do not)
@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (3, "1f1b")])
def test_pipeline_matches_the_single_process_run(single, tmp_path, stages, schedule):
    ref, ref_adapter = single
    rec, got = qft(tmp_path, f"pipe{stages}{schedule}", "offload=pipeline", f"offload.stages={stages}",
                   f"offload.schedule={schedule}", "offload.micro_batches=4", "offload.split=uniform", stages=stages)
    assert rec["status"] == "ok" and rec["pipeline"]["layers"] == [[round(4 * s / stages), round(4 * (s + 1) / stages)]
                                                                   for s in range(stages)]
    assert rec["config_hash"] == ref["config_hash"]  # how it ran is no part of what it computed
    # but it is part of how it ran: with dropout on, the layout changes each stage's masks, so no comparison mixes it
    assert rec["execution"]["pipeline"] == {"layers": rec["pipeline"]["layers"], "micro_batches": 4}
    assert "pipeline stages 0-" in run_kind(rec["execution"]) and "pipeline" not in run_kind(ref["execution"])
    losses = [l for _, l in rec["loss_curve"]]
    ref_losses = [l for _, l in ref["loss_curve"]]
    assert len(losses) == 3 and losses == pytest.approx(ref_losses, rel=1e-4)
    assert got.keys() == ref_adapter.keys() and len(got) == 2 * 7 * 4
    # Adam turns any reduction-order difference in a near-zero gradient into a full step (lr) of either
    # sign, so single elements of B (which starts at zero) may differ by up to 2 lr per step; the adapter
    # as a whole must agree closely
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    assert (flat(got) - flat(ref_adapter)).norm() / flat(ref_adapter).norm() < 3e-3
    for k in got:
        assert (got[k] - ref_adapter[k]).abs().max() <= 2 * 1e-3 * 3, k
    assert rec["final_accuracy"]["test"] == pytest.approx(ref["final_accuracy"]["test"], abs=1 / 15)


def test_a_stopped_pipeline_resumes_from_its_stages_checkpoints(single, tmp_path):
    """The one training loop checkpoints each stage (checkpoint/stage-N); resumed, the run ends where one process does."""
    ref, ref_adapter = single
    pipe = ["offload=pipeline", "offload.stages=2", "offload.micro_batches=4", "offload.split=uniform"]
    env = {**os.environ, "QFT_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qft", *RUN,
              *pipe, f"hydra.run.dir={tmp_path}"]
    res = subprocess.run([*launch, "train.stop_after_steps=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "incomplete"
    assert [json.loads((tmp_path / "checkpoint" / f"stage-{s}" / "meta.json").read_text())["step"] for s in (0, 1)] \
        == [2, 2]
    rec, got = qft(tmp_path.parent, tmp_path.name, *pipe, "train.resume=true", stages=2)
    assert rec["status"] == "ok" and [s for s, _ in rec["loss_curve"]] == [1, 2, 3]
    assert [l for _, l in rec["loss_curve"]] == pytest.approx([l for _, l in ref["loss_curve"]], rel=1e-4)
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    assert (flat(got) - flat(ref_adapter)).norm() / flat(ref_adapter).norm() < 3e-3
    assert not (tmp_path / "checkpoint").exists()  # the finished run supersedes it


def test_balance_follows_peak_memory_not_layer_count():
    # 8 layers, one deliberately heavy (a wide MLP); 1F1B with 4 micro-batches over 2 stages: stage 0 holds
    # 2 micro-batches of activations in flight, stage 1 holds 1
    fixed = [1.0] * 8
    act = [1.0] * 8
    act[6] = 9.0
    b, peaks = stages.balance(fixed, act, 2, 4, "1f1b")
    assert peaks == stages.peaks_of(fixed, act, b, 4, "1f1b")
    uniform = stages.peaks_of(fixed, act, stages.uniform(8, 2), 4, "1f1b")
    assert max(peaks) < max(uniform)
    # the exact optimum over every cut
    best = min(max(stages.peaks_of(fixed, act, [c], 4, "1f1b")) for c in range(1, 8))
    assert max(peaks) == best
    # uniform layers: the early stage, holding more in flight, gets fewer layers
    b, peaks = stages.balance([0.0] * 12, [1.0] * 12, 3, 8, "1f1b")
    edges = [0, *b, 12]
    sizes = [edges[i + 1] - edges[i] for i in range(3)]
    assert sizes[0] < sizes[1] < sizes[2] and sizes == [2, 3, 7]


def test_budget_offloads_the_fewest_early_stages_or_names_the_smallest_that_fits():
    fixed, act = [1.0] * 12, [1.0] * 12
    free = stages.plan_split(fixed, act, 3, 8, "1f1b")
    assert free.offloaded == []
    tight = stages.plan_split(fixed, act, 3, 8, "1f1b", budget=max(free.peaks) - 1)
    assert tight.offloaded == [0] and max(tight.peaks) <= max(free.peaks) - 1
    everything = stages.plan_split(fixed, act, 3, 8, "1f1b", offload_stages=[0, 1, 2])
    with pytest.raises(QftError) as e:
        stages.plan_split(fixed, act, 3, 8, "1f1b", budget=max(everything.peaks) - 0.5)
    assert e.value.key == "offload.device_budget_gb" and "smallest budget that fits" in str(e.value)
    with pytest.raises(QftError):
        stages.plan_split(fixed, act, 3, 8, "1f1b", split=[4, 2])


def test_pipeline_needs_one_process_per_stage(tmp_path):
    res = subprocess.run([sys.executable, "-m", "qft", *RUN, "offload=pipeline", "offload.stages=2",
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "torchrun --nproc-per-node 2" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
