import math
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qft import adapter, budget, model, run
from qft.tools import report
from qft.errors import QftError
from conftest import make_cfg

ROOT = Path(__file__).resolve().parent.parent


def sweep(tmp, *args):
    env = {**os.environ, "QFT_SWEEP_DIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "qft", "+experiment=smoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def records(folder: Path) -> dict:
    return {f.parent.name: json.loads(f.read_text()) for f in folder.glob("*/result.json")}


GRID = {"adapter.attn.r=0,adapter.mlp.r=0", "adapter.attn.r=0,adapter.mlp.r=4",
        "adapter.attn.r=4,adapter.mlp.r=0", "adapter.attn.r=4,adapter.mlp.r=4"}


@pytest.mark.parametrize("launcher", ["basic", "parallel"])
def test_smoke_sweep_writes_one_record_per_grid_point(tmp_path, launcher):
    res = sweep(tmp_path, *([] if launcher == "basic" else ["hydra/launcher=parallel"]))
    assert res.returncode == 0, res.stderr[-2000:]
    recs = records(tmp_path)
    assert set(recs) == GRID and all(r["status"] == "ok" for r in recs.values())
    assert recs["adapter.attn.r=0,adapter.mlp.r=0"]["trainable_params"]["total"] == 0
    attn_only = recs["adapter.attn.r=4,adapter.mlp.r=0"]["trainable_params"]
    assert attn_only["per_layer_type"] == {"attn": 4 * 4 * (128 + 96 + 96 + 128), "mlp": 0}


def test_a_failing_run_does_not_stop_the_sweep_and_only_it_is_redone(tmp_path):
    res = sweep(tmp_path, "adapter.attn.r=4,-1", "adapter.mlp.r=4")
    assert res.returncode == 0, res.stderr[-2000:]
    recs = records(tmp_path)
    bad, good = "adapter.attn.r=-1,adapter.mlp.r=4", "adapter.attn.r=4,adapter.mlp.r=4"
    assert recs[bad]["status"] == "failed" and "adapter.attn.r" in recs[bad]["error"]
    assert recs[good]["status"] == "ok"
    mtime = {k: (tmp_path / k / "result.json").stat().st_mtime_ns for k in (good, bad)}
    again = sweep(tmp_path, "adapter.attn.r=4,-1", "adapter.mlp.r=4", "sweep.blind=true")  # same folders and hash
    assert f"{tmp_path / good} already holds an ok record" in again.stdout
    assert "scores withheld" in again.stdout and "accuracy" not in again.stdout + again.stderr
    assert f"{tmp_path / bad} already holds" not in again.stdout
    assert (tmp_path / good / "result.json").stat().st_mtime_ns == mtime[good]  # skipped
    assert (tmp_path / bad / "result.json").stat().st_mtime_ns > mtime[bad]  # redone
    assert records(tmp_path)[bad]["status"] == "failed"


def test_budget_allocations_hit_their_budgets_on_the_built_model():
    cfg = make_cfg("budget=shares", "budget.params=20000", "budget.tolerance=0.05")
    source = model.resolve(cfg.model, cfg.cache_dir)
    layers = budget.meta_layers(source)
    found = budget.allocations(layers, 20000, "type", 0.05, [0, 1, 2, 4, 8, 16])
    assert found and all(abs(a["params"] - 20000) <= 1000 for a in found)
    for a in found:
        c = make_cfg(f"adapter.attn.r={a['attn']}", f"adapter.mlp.r={a['mlp']}")
        built = run.build(c, source, torch.device("cpu"))
        assert sum(p.numel() for p in built.model.parameters() if p.requires_grad) == a["params"]
    ranks = budget.apply(cfg, layers)
    built = run.build(cfg, source, torch.device("cpu"))
    trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    assert trainable == ranks["attn"] * 1792 + ranks["mlp"] * 2688 and abs(trainable - 20000) <= 1000


def test_budget_depth_split_sets_depth_groups():
    from qft import layers as L

    # shares 1:3:0 must solve to three different ranks: a solver that ignored budget.shares would not
    cfg = make_cfg("budget=shares", "budget.params=30000", "budget.split=depth", "budget.shares=[1,3,0]",
                   "budget.tolerance=0.1")
    source = model.resolve(cfg.model, cfg.cache_dir)
    layers = budget.meta_layers(source)
    ranks = budget.apply(cfg, layers)
    assert ranks["deep"] == 0 and ranks["middle"] > ranks["shallow"] > 0
    plan = adapter.plan(cfg.adapter, layers)
    counts = adapter.count(plan, layers)
    thirds = L.depth_thirds(4)
    for lay in layers:  # every layer's planned rank is its third's
        third = next(g for g, (lo, hi) in thirds.items() if lo <= lay.depth <= hi)
        assert plan[lay.name]["r"] == ranks[third], lay.name
    per_rank = {g: sum(l.in_features + l.out_features for l in layers if lo <= l.depth <= hi)
                for g, (lo, hi) in thirds.items()}  # 1,120 a layer: q/o 128, k/v 96, gate/up/down 224
    assert {g: counts["per_depth_group"][g] for g in thirds} == {g: ranks[g] * per_rank[g] for g in thirds}
    assert abs(counts["total"] - 30000) <= 3000
    share = counts["per_depth_group"]["middle"] / counts["total"]
    assert abs(share - 0.75) < 0.1  # 3 of 4 shares


def test_budget_below_the_smallest_allocation():
    cfg = make_cfg("budget=shares", "budget.params=100")
    with pytest.raises(QftError) as e:
        budget.solve(budget.meta_layers(model.resolve(cfg.model, cfg.cache_dir)), cfg.budget)
    assert e.value.key == "budget.params" and "1,792" in str(e.value)


def cli(*args, module="qft"):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [(["+experiment=nope"], "Could not find 'experiment/nope'"),
                                         (["+experiment=smoke", "adapter.attn.r=choice()"],
                                          "choice"),
                                         ])
def test_bad_sweep_specs_exit_2_with_one_line(args, needle, tmp_path):
    res = subprocess.run([sys.executable, "-m", "qft", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "QFT_SWEEP_DIR": str(tmp_path)})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr[-1500:]


def test_budget_cli():
    res = cli("model=tiny_llama", "budget.params=20000", module="qft.budget")
    assert res.returncode == 0 and "| 8 | 2 | 19,712 | -1.44% |" in res.stdout
    res = cli("model=tiny_llama", "budget.params=10", module="qft.budget")
    assert res.returncode == 2 and res.stderr.strip().startswith("qft.budget: error: budget.params=10")


def test_report_table_and_plots(tmp_path):
    runs = tmp_path / "runs"
    for attn_r in (0, 4):
        for mlp_r in (0, 4):
            for seed in (0, 1, 2) if attn_r == mlp_r == 4 else (0, 1):  # 3 seeds: the least a verdict takes
                cfg = make_cfg(f"adapter.attn.r={attn_r}", f"adapter.mlp.r={mlp_r}", f"seed={seed}",
                               "data.train_size=16", "data.val_size=5", "data.test_size=10",
                               "train.steps=1", "train.batch_size=4", "train.zero_shot=false",
                               "train.checkpoint_every=0", "train.eval_every=0")
                cfg.experiment = "unit"
                run.run(cfg, runs / f"a{attn_r}m{mlp_r}s{seed}")
    files = report.report([runs], tmp_path / "out")
    import pandas as pd

    df = pd.read_csv(files["csv"])
    assert len(df) == 9 and set(df.status) == {"ok"}
    assert sorted(df.params.unique()) == [0, 7168, 10752, 17920]
    assert len(pd.read_parquet(files["parquet"])) == 9
    summary = files["summary"].read_text()
    assert summary.startswith("9 runs: 9 ok") and summary.count("| 2 |") == 2 and summary.count("| 3 |") == 1
    assert summary.count("| 1 | ") == 1 and "one evaluation" in summary  # the untrained cell: deterministic, once
    assert "(paired-crossed;" in summary.split("\n")[0] and "keep no per-example" not in summary  # new records: paired
    # each class's accuracy, mean over seeds, recomputed here from the committed per-example predictions
    from qft.record import read_examples

    classes = files["classes"].read_text().splitlines()
    labels = json.loads((runs / "a4m4s0" / "result.json").read_text())["data"]["labels"]
    rows = {s: read_examples(runs / f"a4m4s{s}")["final.test"] for s in (0, 1, 2)}
    gold = rows[0]["gold"]
    seen = [c for c in range(len(labels)) if (gold == c).any()]
    assert classes[2] == "| " + " | ".join(["adapted", "attn_r", "mlp_r", "n", *(
        f"{labels[c]} ({int((gold == c).sum())})" for c in seen)]) + " |"
    want = [np.mean([((r["gold"] == c) & (r["pred"] == c)).sum() / (gold == c).sum() for r in rows.values()])
            for c in seen]
    assert "| attn+mlp | 4 | 4 | 3 | " + " | ".join(f"{w:.3f}" for w in want) + " |" in classes
    # seeds that differ (one training step gives the same predictions on every seed): the mean, not one seed's
    df = pd.DataFrame({"status": "ok", "cell_key": ["k"] * 3 + ["u"], "seed": [0, 1, 2, 0],
                       "acc_class_earn": [0.5, 0.75, 1.0, 0.0], "n_class_earn": 4, "acc_class_grain": [0.0, 0.5, 0.5, 1.0],
                       "n_class_grain": 2})
    g = pd.DataFrame({"cell_key": ["u", "k"], "adapted": ["none", "attn"], "attn_r": [0, 4], "n_seeds": [1, 3]})
    assert report.classes_markdown(g, df).splitlines()[2:] == [
        "| adapted | attn_r | n | earn (4) | grain (2) |", "|---|---|---|---|---|",
        "| none | 0 | 1 | 0.000 | 1.000 |", "| attn | 4 | 3 | 0.750 | 0.333 |"]
    plan = tmp_path / "plan.yaml"
    plan.write_text("margin: 0.05\ncontrasts:\n  - {name: both at 4 vs untrained, a: {attn_r: 4, mlp_r: 4}, "
                    "b: {attn_r: 0, mlp_r: 0}}\n  - {name: missing cell, a: {attn_r: 9}, b: {attn_r: 4}}\n"
                    "  - {name: two seeds only, a: {attn_r: 4, mlp_r: 0}, b: {attn_r: 0, mlp_r: 4}}\n")
    files = report.report([runs], tmp_path / "out2", plan=plan)
    text = files["contrasts"].read_text()
    # Holm over the whole declared family of 3; two trained cells sharing 2 seeds get no verdict
    assert "Holm across all 3, 2 of them not computable" in text and "| missing cell | - |" in text
    # a cell no record matches, and one named too loosely to tell two configurations apart ((4, 4) and (4, 0))
    assert "| not computable: cell a matches no records; cell b matches 2 configurations |" in text
    assert "| two seeds only | - |" in text
    row = json.loads((tmp_path / "out2" / "contrasts.json").read_text())[0]
    assert row["method"] == "paired-crossed" and row["n_seeds"] == 3 and row["n_examples"] == 10
    assert set(row["components"]) == {"seed", "example", "residual"} and "finds (80%)" in text
    assert row["verdict"] in ("differs", "equivalent", "inconclusive")
    assert row["p_adj"] == pytest.approx(min(1.0, 3 * row["p"]))  # Holm's first step over a family of 3
    assert row["loglik"]["method"] == "paired-crossed" and row["loglik"]["verdict"] != "equivalent"  # no margin: never
    # a seed the plan declares and a cell lacks: no verdict on the secondary measure either (even where the seeds it
    # has would be enough, as they are here with MIN_SEEDS at 2), and p = 1 in its Holm family
    from qft.tools.report import compare

    df = report.collect([runs])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "MIN_SEEDS", 2)
        rows, _ = report.contrasts(df, report.grouped(df), {**report.read_plan(plan), "seeds": [0, 1, 2]})
    assert "loglik" in rows[0] and rows[0]["n_seeds"] == 3  # (4, 4) against untrained: all three declared seeds
    assert "loglik" not in rows[2] and "diff" not in rows[2]  # two seeds only: not run
    # one trained seed against the untrained cell: a paired t over examples alone cannot see training noise (56%
    # coverage simulated), so no verdict, as for trained cells under 3 seeds
    one = tmp_path / "one_seed"
    for name in ("a4m4s0", "a0m0s0"):
        shutil.copytree(runs / name, one / name)
    plan.write_text("contrasts:\n  - {name: one seed vs untrained, a: {attn_r: 4, mlp_r: 4}, b: {attn_r: 0, mlp_r: 0}}\n")
    text = report.report([one], tmp_path / "out3", plan=plan)["contrasts"].read_text()
    assert "| one seed vs untrained | - |" in text and "1 of them not computable" in text
    for name in ("accuracy_vs_params", "rank_heatmap"):
        assert files[name].stat().st_size > 10_000 and files[name].read_bytes()[:4] == b"\x89PNG"


def test_parallel_jobs_get_their_own_gpu(monkeypatch, tmp_path):
    from qft.__main__ import pin_gpu

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: H100 (UUID: a)'\necho 'GPU 1: H100 (UUID: b)'\necho 'GPU 2: H100 (UUID: c)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert [pin_gpu(n, {}) for n in range(5)] == ["0", "1", "2", "0", "1"]
    assert pin_gpu(4, {"SLURM_JOB_ID": "7"}) is None
    assert pin_gpu(4, {"CUDA_VISIBLE_DEVICES": "3"}) is None


def test_report_uses_the_ranks_a_budget_solved(tmp_path):
    cfg = make_cfg("budget=shares", "budget.params=20000", "budget.tolerance=0.05", "data.train_size=16",
                   "data.val_size=5", "data.test_size=10", "train.steps=1", "train.batch_size=4",
                   "train.zero_shot=false", "train.checkpoint_every=0", "train.eval_every=0")
    rec = run.run(cfg, tmp_path / "b")
    df = report.collect([tmp_path])
    assert (df.attn_r[0], df.mlp_r[0]) == (rec["budget_ranks"]["attn"], rec["budget_ranks"]["mlp"])
    assert df.params[0] == rec["budget_ranks"]["attn"] * 1792 + rec["budget_ranks"]["mlp"] * 2688


def _record(folder: Path, source: str, attn_r: int, mlp_r: int, seed: int, acc: float, execution=None,
            eval_batch: int | None = None) -> None:
    """A minimal ok record, as run.run writes them: the report reads only these keys."""
    folder.mkdir(parents=True)
    config = {"experiment": "unit", "seed": seed, "model": {"name": "m"}, "data": {"source": source},
              "adapter": {"attn": {"r": attn_r, "alpha": 16}, "mlp": {"r": mlp_r, "alpha": 16}}}
    if eval_batch is not None:
        config["train"] = {"eval_batch_size": eval_batch}
    (folder / "result.json").write_text(json.dumps({
        "status": "ok", "config": config, "config_hash": f"{source}{attn_r}{mlp_r}{seed}", "seed": seed,
        "trainable_params": {"total": 10 * attn_r + 20 * mlp_r, "per_layer_type": {"attn": 10 * attn_r,
                                                                                  "mlp": 20 * mlp_r}},
        "final_accuracy": {"test": acc, "val": acc}, "train_tokens_per_second": 1.0, "execution": execution}))


def test_no_pair_mixes_cpu_kinds_threads_or_compute_dtypes(tmp_path):
    """docs/studies.md: a difference between machines is not a difference between configurations, so the two cells
    of one seed (a pair) never mix kinds: such a pair is refused and named, and the contrast goes on without it."""
    here = {"cpu_kind": "avx512_bf16", "threads": 1, "compute_dtype": "bf16", "cuda": None}
    for (a, m), values in {(2, 2): [0.80, 0.82, 0.84], (8, 8): [0.90, 0.91, 0.92]}.items():
        for seed, acc in enumerate(values):
            _record(tmp_path / "runs" / f"{a}{m}{seed}", "bbc", a, m, seed, acc, here)
    plan = {"margin": 0.02, "alpha": 0.05, "metric": "accuracy",
            "contrasts": [{"name": "8 vs 2", "a": {"attn_r": 8, "mlp_r": 8}, "b": {"attn_r": 2, "mlp_r": 2}}]}

    def tables():  # the report's two tables, without its plots, and the contrast's row
        df = report.collect([tmp_path / "runs"])
        g = report.grouped(df)
        rows, text = report.contrasts(df, g, plan)
        return text, report.markdown(g, df), rows[0]

    text, _, row = tables()
    assert row["n_seeds"] == 3 and "Run kinds: every pair ran on one kind (avx512_bf16, 1 thread, bf16)" in text
    for change in ({"threads": 2}, {"cpu_kind": "amx"}, {"compute_dtype": "fp32"}, {"cpu_id": "family 26 model 2"},
                   None):
        shutil.rmtree(tmp_path / "runs" / "882")
        _record(tmp_path / "runs" / "882", "bbc", 8, 8, 2, 0.92, None if change is None else {**here, **change})
        text, summary, row = tables()
        want = {None: "not recorded", "threads": "avx512_bf16, 2 threads, bf16", "cpu_kind": "amx, 1 thread, bf16",
                "compute_dtype": "avx512_bf16, 1 thread, fp32", "cpu_id": "family 26 model 2 avx512_bf16, 1 thread, bf16"}
        assert f"- 8 vs 2, seed 2: 882 on {want[change and next(iter(change))]}; 222 on avx512_bf16, 1 thread, bf16" \
            in text, text
        assert row["n_seeds"] == 2 and row["diff"] == pytest.approx(0.905 - 0.81)  # the two pairs of one kind
        assert [r["seed"] for r in row["refused_pairs"]] == [2]
        assert "pairs refused in the comparison of attn_r 2, mlp_r 2 with the best, their two cells on different " \
               "run kinds: seed 2 (222 on avx512_bf16, 1 thread, bf16; 882 on " in summary
    # the evaluation's batch size is unhashed (it trains nothing differently) but moves bf16 label scores: a pair
    # scored at two batch sizes is refused, and at one it stands
    for batch, comparable in ((32, True), (64, False)):
        for (a, m), values in {(2, 2): [0.80, 0.82, 0.84], (8, 8): [0.90, 0.91, 0.92]}.items():
            for seed, acc in enumerate(values):
                shutil.rmtree(tmp_path / "runs" / f"{a}{m}{seed}")
                _record(tmp_path / "runs" / f"{a}{m}{seed}", "bbc", a, m, seed, acc, here,
                        batch if (a, seed) == (8, 2) else 32)
        text, summary, row = tables()
        assert row["n_seeds"] == (3 if comparable else 2), batch
        assert comparable or "882 on avx512_bf16, 1 thread, bf16, eval batch 64; 222 on avx512_bf16, 1 thread, " \
            "bf16, eval batch 32" in text, text


def test_a_repeated_configuration_and_seed_is_named_not_dropped_silently(tmp_path):
    """Two records of one config and seed (another machine or pipeline layout: neither is hashed) cannot both be a
    seed: the tables keep the last by folder and say which were left out."""
    for seed, acc in enumerate([0.90, 0.91, 0.92]):
        _record(tmp_path / "runs" / f"a{seed}", "bbc", 8, 8, seed, acc)
    _record(tmp_path / "runs" / "b1", "bbc", 8, 8, 1, 0.95)
    df = report.collect([tmp_path / "runs"])
    g = report.grouped(df)
    assert g.n_seeds.tolist() == [3] and g.acc_mean.tolist() == pytest.approx([np.mean([0.90, 0.95, 0.92])])
    assert "- 1 of 4 records repeat the configuration and seed of another and are left out (the last by folder " \
           "stands): a1" in report.markdown(g, df)
    # a declared contrast keeps the same record of that seed, and its table names the one left out
    for seed, acc in enumerate([0.80, 0.82, 0.84]):
        _record(tmp_path / "runs" / f"c{seed}", "bbc", 2, 2, seed, acc)
    df = report.collect([tmp_path / "runs"])
    plan = {"margin": 0.02, "alpha": 0.05, "metric": "accuracy",
            "contrasts": [{"name": "8 vs 2", "a": {"attn_r": 8, "mlp_r": 8}, "b": {"attn_r": 2, "mlp_r": 2}}]}
    rows, text = report.contrasts(df, report.grouped(df), plan)
    assert rows[0]["n_seeds"] == 3 and rows[0]["diff"] == pytest.approx(np.mean([0.90, 0.95, 0.92]) - 0.82)
    assert "Left out as repeating the configuration and seed of another record (the last by folder stands): a1" in text


def test_declared_contrasts_use_exactly_the_plans_seeds(tmp_path):
    """A plan's verdicts are on its declared seeds (the amended list where there is one): a report run mid-study says
    "not run" rather than giving a verdict on fewer, and a seed beyond the list does not enter."""
    for (a, m), values in {(2, 2): [0.80, 0.82, 0.84, 0.99], (8, 8): [0.90, 0.91, 0.92]}.items():
        for seed, acc in enumerate(values):
            _record(tmp_path / "runs" / f"{a}{m}{seed}", "bbc", a, m, seed, acc)
    df = report.collect([tmp_path / "runs"])
    g = report.grouped(df)
    base = {"margin": 0.02, "alpha": 0.05, "metric": "accuracy",
            "contrasts": [{"name": "8 vs 2", "a": {"attn_r": 8, "mlp_r": 8}, "b": {"attn_r": 2, "mlp_r": 2}}]}
    rows, text = report.contrasts(df, g, {**base, "seeds": [0, 1, 2], "seeds_amended": [0, 1, 2, 3]})
    assert "| not run: 3 of the 4 declared seeds in both cells (missing 3) |" in text and "diff" not in rows[0]
    rows, text = report.contrasts(df, g, {**base, "seeds": [0, 1, 2]})
    assert rows[0]["n_seeds"] == 3 and "each on exactly the declared seeds 0, 1, 2" in text
    assert rows[0]["diff"] == pytest.approx(0.91 - 0.82)  # seed 3's 0.99 left out
    assert report.contrasts(df, g, base)[0][0]["diff"] == pytest.approx(0.91 - np.mean([0.80, 0.82, 0.84, 0.99]))
    # a cell whose records all sit on undeclared seeds is not run, not an untrained cell
    rows, text = report.contrasts(df, g, {**base, "seeds": [5, 6, 7]})
    assert "| not run: 0 of the 3 declared seeds in both cells (missing 5, 6, 7) |" in text
    for bad in ("seeds: 3", "seeds: []", "seeds_amended: [0, x]"):
        (tmp_path / "plan.yaml").write_text(f"contrasts: [{{name: c, a: {{attn_r: 8}}, b: {{attn_r: 2}}}}]\n{bad}\n")
        with pytest.raises(ValueError, match="seeds"):
            report.read_plan(tmp_path / "plan.yaml")


def test_a_plans_amended_contrasts_replace_its_declared_ones(tmp_path):
    """contrasts_amended (a dated amendment) is what the report reads, the declared list staying in the file; a
    malformed amended list is refused like a malformed declared one."""
    (tmp_path / "plan.yaml").write_text("contrasts: [{name: c, a: {attn_r: 8}, b: {attn_r: 2}}]\n"
                                        "contrasts_amended: [{name: d, a: {attn_r: 8, seed_draw: 1}, b: {attn_r: 1}}]\n")
    plan = report.read_plan(tmp_path / "plan.yaml")
    assert [c["name"] for c in plan["contrasts"]] == ["d"] and plan["contrasts"][0]["a"] == {"attn_r": 8, "seed_draw": 1}
    (tmp_path / "plan.yaml").write_text("contrasts: [{name: c, a: {attn_r: 8}, b: {attn_r: 2}}]\ncontrasts_amended: [x]\n")
    with pytest.raises(ValueError, match="contrasts_amended must be a list"):
        report.read_plan(tmp_path / "plan.yaml")


def test_report_splits_datasets_and_says_which_differences_beat_the_noise(tmp_path):
    accs = {("bbc", 2, 2): [0.80, 0.82, 0.84], ("bbc", 8, 8): [0.90, 0.91, 0.92],   # far apart: beyond noise
            ("reuters", 2, 2): [0.60, 0.70, 0.80], ("reuters", 8, 8): [0.65, 0.70, 0.75]}  # within noise
    for (source, a, m), values in accs.items():
        for seed, acc in enumerate(values):
            _record(tmp_path / "runs" / f"{source}{a}{m}{seed}", source, a, m, seed, acc)
    files = report.report([tmp_path / "runs"], tmp_path / "out")
    bbc, reuters = (files[f"{s}/summary"].read_text() for s in ("bbc", "reuters"))
    assert files["bbc/summary"] == tmp_path / "out" / "bbc" / "summary.md"
    assert bbc.startswith("6 runs: 6 ok") and reuters.startswith("6 runs: 6 ok")  # never pooled across datasets
    # bbc: 0.82 vs 0.91, sd 0.02 and 0.01 over 3 seeds: Welch with its exact 2.94 degrees of freedom (scipy)
    from scipy import stats as st

    welch = st.ttest_ind(accs[("bbc", 2, 2)], accs[("bbc", 8, 8)], equal_var=False)
    ci = welch.confidence_interval(0.95)
    # and beyond ±0.02 by the minimum-effect test on the same t: at a true difference of 0.02, an estimate as far
    # from 0 either side (one comparison)
    se = 0.090 / abs(welch.statistic)
    beyond = st.t.sf((0.090 - 0.02) / se, welch.df) + st.t.sf((0.090 + 0.02) / se, welch.df)
    assert beyond < 0.05
    # equivalence within ±0.02 (TOST): the larger of the two one-sided p-values, here near 1
    tost = max(st.t.sf((-0.090 + 0.02) / se, welch.df), st.t.cdf((-0.090 - 0.02) / se, welch.df))
    assert f"| 0.820 | ±{st.t.ppf(0.975, 2) * 0.02 / math.sqrt(3):.3f} | -0.090 [{ci.low:+.3f}, {ci.high:+.3f}] " \
           f"p_adj {welch.pvalue:.2g}, TOST p_adj {tost:.2g} differs (by more than ±0.02) |" in bbc
    assert "| 0.910 |" in bbc and "| best |" in bbc and "The reference is the best cell on this same test set" in bbc
    # reuters: 0.70 vs 0.70 with wide spreads: neither a difference nor equivalence within 0.02
    assert "inconclusive" in reuters and "differs" not in reuters.split("\n", 2)[2]
    g = report.grouped(report.collect([tmp_path / "runs"]).query("`cfg.data.source` == 'bbc'"))
    assert g.vs_diff[0] == pytest.approx(-0.09) and (g.vs_low[0], g.vs_high[0]) == pytest.approx((ci.low, ci.high))


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy's reference on a constant cell
def test_report_compares_with_a_reference_within_groups(tmp_path):
    """bits_sweep's question: each cut against rank 8 everywhere at the same bits, never across bits."""
    accs = {(4, 8, 8): [0.70, 0.72, 0.74], (4, 3, 8): [0.60, 0.61, 0.62],    # 4-bit: the cut costs 0.11
            (8, 8, 8): [0.80, 0.80, 0.80], (8, 3, 8): [0.80, 0.81, 0.82]}    # 8-bit: within the noise
    for (bits, a, m), values in accs.items():
        for seed, acc in enumerate(values):
            folder = tmp_path / "runs" / f"b{bits}a{a}s{seed}"
            _record(folder, "reuters", a, m, seed, acc)
            rec = json.loads((folder / "result.json").read_text())
            rec["config"]["quant"] = {"attn": {"bits": bits}, "mlp": {"bits": bits}}
            rec["trainable_params"]["per_depth_group"] = {t: (10 * a + 20 * m) / 3 for t in report.THIRDS}
            (folder / "result.json").write_text(json.dumps(rec))
    files = report.report([tmp_path / "runs"], tmp_path / "out", {"attn_r": "8", "mlp_r": "8"}, ("attn_bits",))
    text = files["summary"].read_text()
    assert "| adapted | attn_r | attn_bits | mlp_bits | params |" in text
    assert "The reference is named on the command line" in text and "best cell" not in text
    rows = {(c[3].strip(), c[2].strip()): line for line in text.splitlines()[4:] if line.startswith("|")
            for c in [line.split("|")]}
    # Welch (scipy), Holm across the two comparisons: the 4-bit cut differs, the 8-bit one is inconclusive
    from scipy import stats as st

    w4 = st.ttest_ind(accs[(4, 3, 8)], accs[(4, 8, 8)], equal_var=False)
    w8 = st.ttest_ind(accs[(8, 3, 8)], accs[(8, 8, 8)], equal_var=False)
    holm = sorted([w4.pvalue, w8.pvalue])
    c4, c8 = w4.confidence_interval(), w8.confidence_interval()
    from statsmodels.stats.multitest import multipletests

    beyond = multipletests([min(1.0, st.t.sf(abs(w.statistic) * (1 - 0.02 / abs(d)), w.df)
                                + st.t.sf(abs(w.statistic) * (1 + 0.02 / abs(d)), w.df))
                            for w, d in ((w4, -0.110), (w8, 0.010))], method="holm")[1]
    word = "differs (by more than ±0.02)" if beyond[0] < 0.05 else "differs"
    tost = multipletests([max(st.t.sf((d + 0.02) / (abs(d) / abs(w.statistic)), w.df),
                              st.t.cdf((d - 0.02) / (abs(d) / abs(w.statistic)), w.df))
                          for w, d in ((w4, -0.110), (w8, 0.010))], method="holm")[1]
    assert rows[("4", "3")].endswith(f"| -0.110 [{c4.low:+.3f}, {c4.high:+.3f}] p_adj {2 * holm[0]:.2g}, TOST p_adj "
                                     f"{tost[0]:.2g} {word} | 1 |")
    assert rows[("8", "3")].endswith(f"| +0.010 [{c8.low:+.3f}, {c8.high:+.3f}] p_adj {max(2 * holm[0], holm[1]):.2g}, "
                                     f"TOST p_adj {tost[1]:.2g} inconclusive | 1 |")
    assert "| reference |" in rows[("4", "8")] and "| reference |" in rows[("8", "8")]
    assert "params_shallow" not in text  # thirds of equal size are no depth study
    assert files["cells"].read_bytes()[:4] == b"\x89PNG"
    res = cli(str(tmp_path / "runs"), "--out", str(tmp_path / "o2"), "--versus", "bits=4", module="qft.tools.report")
    assert res.returncode == 2 and res.stderr.strip().startswith("qft.tools.report: error: column 'bits' is not in")


def test_report_shows_depth_thirds_when_a_configuration_makes_them_uneven(tmp_path):
    for seed in (0, 1):
        for cut, per_third in (("none", [80, 80, 80]), ("deep", [80, 80, 20])):
            folder = tmp_path / "runs" / f"{cut}{seed}"
            _record(folder, "reuters", 8, 8, seed, 0.7 + 0.01 * seed - (0.1 if cut == "deep" else 0))
            rec = json.loads((folder / "result.json").read_text())
            rec["config"]["adapter"]["depth_groups"] = {} if cut == "none" else {"deep": {"layers": [2, 2], "r": 2}}
            rec["config_hash"] += cut
            rec["trainable_params"]["per_depth_group"] = dict(zip(report.THIRDS, per_third))
            rec["trainable_params"]["total"] = sum(per_third)
            (folder / "result.json").write_text(json.dumps(rec))
    files = report.report([tmp_path / "runs"], tmp_path / "out")
    text = files["summary"].read_text()
    assert "| params_shallow | params_middle | params_deep | params |" in text
    assert "| 80 | 80 | 20 | 180 | 2 | 0.605 |" in text and "| 80 | 80 | 80 | 240 | 2 | 0.705 |" in text
    assert files["cells"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only: VmHWM reset")
def test_each_run_records_its_own_peak_not_an_earlier_jobs_of_the_same_process(tmp_path):
    import mmap

    import torch

    from qft import record

    # 1 GiB touched and handed back to the OS, as an earlier job of a sweep leaves its peak behind (mmap, not
    # malloc: with accel.host_allocator=tuned, freed heap memory stays resident by design). The run's own growth
    # above what is resident is about 130 MB here, so 400 MB left too thin a margin (failed once: 290 MB below)
    big = mmap.mmap(-1, 1024 * 2 ** 20)
    big.write(b"\1" * len(big))
    big.close()
    before = record.peak_memory(torch.device("cpu"))["peak_rss_bytes"]
    # a run (as a sweep's next job in this same process) must record its own peak, not the 1 GiB above
    rec = run.run(make_cfg("data.train_size=16", "data.val_size=5", "data.test_size=5", "train.steps=1",
                           "train.batch_size=4", "train.zero_shot=false", "train.checkpoint_every=0",
                           "train.eval_every=0"), tmp_path)
    assert before - rec["memory"]["peak_rss_bytes"] > 600e6, (before, rec["memory"])


def test_report_draws_learning_curves_labelled_by_what_differs(tmp_path):
    runs = tmp_path / "runs"
    for lr in ("1e-3", "3e-3"):
        cfg = make_cfg(f"train.lr={lr}", "data.train_size=16", "data.val_size=5", "data.test_size=5",
                       "train.steps=4", "train.batch_size=4", "train.zero_shot=false", "train.checkpoint_every=0",
                       "train.eval_every=1")  # validation at steps 1-3; the last step's is the final score
        cfg.experiment = "pilot"
        run.run(cfg, runs / f"lr{lr}")
    files = report.report([runs], tmp_path / "out")
    table = files["learning_curves"].with_suffix(".md").read_text().splitlines()
    assert table[0] == ("| step | val acc (train.lr=0.001) | val gold loglik (train.lr=0.001) | "
                        "val acc (train.lr=0.003) | val gold loglik (train.lr=0.003) |")
    rec = json.loads((runs / "lr1e-3" / "result.json").read_text())
    assert [r.split(" | ")[0] for r in table[2:]] == ["| 1", "| 2", "| 3"]
    assert table[4].split(" | ")[1:3] == [f"{rec['val_curve'][2][1]:.4f}", f"{rec['val_loglik_curve'][2][1]:.4f}"]
    assert files["learning_curves"].read_bytes()[:4] == b"\x89PNG"


def test_the_smoke_study_writes_its_records_under_the_ignored_outputs_folder(monkeypatch):
    """`python -m qft +experiment=smoke` (docs/studies.md) checks the machinery; its records are nobody's study, so they
    land in git-ignored outputs/smoke/runs, never as an untracked results/smoke/ in the working tree."""
    from hydra import compose, initialize_config_dir

    from qft import config

    monkeypatch.delenv("QFT_SWEEP_DIR", raising=False)
    with initialize_config_dir(config.CONF, version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=smoke"], return_hydra_config=True)
    where = str(cfg.hydra.sweep.dir)
    assert where == "outputs/smoke/runs"
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{where}/adapter.attn.r=0,adapter.mlp.r=0/result.json"],
                             cwd=ROOT)
    assert ignored.returncode == 0  # 1: git would show the records as untracked files
