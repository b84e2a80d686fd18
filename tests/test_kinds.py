"""Studies on whatever CPU kind the machine has (docs/studies.md, "Run kinds"): cells matched across kinds by the cell
key, pairs of one kind pooled across kinds with a per-kind split, and a plan's positive controls and relative margin."""
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

from qft import record, stats
from qft.tools import report
from conftest import make_cfg, write_test_examples

BF16 = {"cpu": "AMD EPYC", "cpu_kind": "avx512_bf16", "threads": 2, "compute_dtype": "bf16", "torch": "2.13.0"}
FP32 = {"cpu": "AMD EPYC", "cpu_kind": "avx2", "threads": 2, "compute_dtype": "fp32", "torch": "2.13.0"}


def test_the_cell_key_leaves_out_the_compute_dtype_the_device_and_the_seed_and_nothing_else():
    conf = record.resolved(make_cfg())
    fp32 = record.resolved(make_cfg("quant.compute_dtype=fp32"))
    assert record.config_hash(fp32, inputs_={}) != record.config_hash(conf, inputs_={})  # still hashed
    assert record.cell_key(fp32) == record.cell_key(conf) == record.cell_key({**conf, "device": "auto"})
    assert record.cell_key(record.resolved(make_cfg("seed=7"))) == record.cell_key(conf)
    for other in ("adapter.attn.r=2", "quant.attn.bits=8", "train.steps=7", "train.lr=0.01", "data.split_seed=3"):
        assert record.cell_key(record.resolved(make_cfg(other))) != record.cell_key(conf), other
    assert record.cell_key(conf, {"data_file": "x"}) != record.cell_key(conf, {"data_file": "y"})  # inputs enter
    assert conf["quant"]["compute_dtype"] != "fp32" and conf["device"] == "cpu"  # the caller's config is untouched


def _record(folder: Path, r: int, seed: int, correct: np.ndarray, execution: dict | None) -> None:
    """An ok record with per-example scores, as run.run writes them: the config names the kind's compute dtype."""
    folder.mkdir(parents=True)
    dtype = (execution or {}).get("compute_dtype", "bf16")
    config = {"experiment": "unit", "seed": seed, "model": {"name": "m"}, "data": {"source": "bbc"},
              "quant": {"compute_dtype": dtype}, "adapter": {"attn": {"r": r}, "mlp": {"r": r}},
              "train": {"eval_batch_size": 32}}
    write_test_examples(folder, correct)
    (folder / "result.json").write_text(json.dumps({
        "status": "ok", "config": config, "config_hash": record.config_hash(config), "seed": seed,
        "trainable_params": {"total": 10 * r, "per_layer_type": {"attn": 4 * r, "mlp": 6 * r}},
        "final_accuracy": {"test": float(correct.mean()), "val": 0.5}, "train_tokens_per_second": 1.0,
        "execution": execution, "examples": "examples.npz"}))


def _study(runs: Path, kinds: dict) -> dict:
    """Cells r=8 and r=1 on 200 examples, 6 seeds; `kinds`: seed -> (cell 8's kind, cell 1's kind). On the bf16
    kind the cut costs about 0.12, on the fp32 kind about 0.01: a contrast that depends on the kind."""
    rng = np.random.default_rng(7)
    out = {}
    for seed in range(6):
        b = (rng.random(200) < 0.6).astype(int)
        gain = 0.30 if seed < 3 else 0.03  # the share of b's misses that a gets right
        a = np.where(rng.random(200) < gain + rng.normal(0, 0.02), 1, b)
        for r, correct, kind in ((8, a, kinds[seed][0]), (1, b, kinds[seed][1])):
            _record(runs / f"r{r}s{seed}", r, seed, correct, kind)
        out[seed] = float((a - b).mean())
    return out


PLAN = "margin: 0.02\ncontrasts:\n  - {name: cut 8 -> 1, a: {attn_r: 8}, b: {attn_r: 1}}\n"


def test_a_studys_records_from_two_run_kinds_go_through_the_report_with_a_per_kind_split(tmp_path):
    """Seeds 0-2 ran on an AVX512-BF16 machine in bf16, seeds 3-5 on an AVX2 one in fp32, each seed's cells on one
    kind: one cell key per cell, the contrast pools the six pairs, and the report splits it by kind and tests the
    split with the one-way ANOVA of the pairs' differences (F and p recomputed here by hand)."""
    d = _study(tmp_path / "runs", {s: (BF16, BF16) if s < 3 else (FP32, FP32) for s in range(6)})
    (tmp_path / "plan.yaml").write_text(PLAN)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--plan",
                        str(tmp_path / "plan.yaml")]) == 0
    df = report.collect([tmp_path / "runs"])
    assert df.config_key.nunique() == 4 and df.cell_key.nunique() == 2  # bf16 and fp32 hash apart, match as cells
    row = json.loads((tmp_path / "out" / "contrasts.json").read_text())[0]
    assert row["n_seeds"] == 6 and row["method"] == "paired-crossed" and row["refused_pairs"] == []
    assert row["diff"] == pytest.approx(np.mean(list(d.values())))
    kinds = {k["kind"]: k for k in row["kinds"]}
    bf16, fp32 = "AMD EPYC avx512_bf16, 2 threads, bf16, torch 2.13.0, eval batch 32", \
        "AMD EPYC avx2, 2 threads, fp32, torch 2.13.0, eval batch 32"
    assert sorted(kinds) == [fp32, bf16] and kinds[bf16]["seeds"] == [0, 1, 2] and kinds[fp32]["seeds"] == [3, 4, 5]
    groups = [np.array([d[s] for s in range(3)]), np.array([d[s] for s in range(3, 6)])]
    assert kinds[bf16]["diff"] == pytest.approx(groups[0].mean()) and kinds[fp32]["diff"] == pytest.approx(groups[1].mean())
    grand = np.concatenate(groups).mean()
    between = sum(3 * (g.mean() - grand) ** 2 for g in groups) / 1
    within = sum(((g - g.mean()) ** 2).sum() for g in groups) / 4
    het = row["heterogeneity"]
    assert het["df"] == [1, 4] and het["F"] == pytest.approx(between / within)
    assert het["p"] == pytest.approx(st.f.sf(between / within, 1, 4)) and het["p"] < 0.05  # the kinds differ here
    text = (tmp_path / "out" / "contrasts.md").read_text()
    assert f"| cut 8 -> 1 | {fp32} | 3 | {groups[1].mean():+.4f} | [" in text  # kinds in name order
    assert f"|  | {bf16} | 3 | {groups[0].mean():+.4f} | [" in text
    assert f"F(1, 4) = {between / within:.3g}, p {het['p']:.3g}" in text
    # the per-kind interval is the report's own comparison on that kind's three pairs
    a = {s: np.load(tmp_path / "runs" / f"r8s{s}" / "examples.npz")["final.test.correct"] for s in range(3)}
    b = {s: np.load(tmp_path / "runs" / f"r1s{s}" / "examples.npz")["final.test.correct"] for s in range(3)}
    own = stats.paired(np.stack([a[s] for s in range(3)]), np.stack([b[s] for s in range(3)]), 0.02)
    assert (kinds[bf16]["low"], kinds[bf16]["high"]) == pytest.approx((own.low, own.high))


def test_only_a_pair_whose_cells_ran_on_two_kinds_is_refused(tmp_path):
    """Seed 5's r=1 cell ran on the bf16 machine, its r=8 cell on the fp32 one: that pair is named and left out, the
    other five pairs stand (the contrast and the fp32 kind's split on two)."""
    d = _study(tmp_path / "runs", {**{s: (BF16, BF16) if s < 3 else (FP32, FP32) for s in range(5)}, 5: (FP32, BF16)})
    (tmp_path / "plan.yaml").write_text(PLAN)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--plan",
                        str(tmp_path / "plan.yaml")]) == 0
    row = json.loads((tmp_path / "out" / "contrasts.json").read_text())[0]
    assert row["n_seeds"] == 5 and row["diff"] == pytest.approx(np.mean([d[s] for s in range(5)]))
    assert [(k["seeds"]) for k in row["kinds"]] == [[3, 4], [0, 1, 2]]  # avx2 sorts before avx512
    assert row["refused_pairs"] == [{"seed": 5, "a": "r8s5", "kind_a": "AMD EPYC avx2, 2 threads, fp32, torch 2.13.0, "
                                     "eval batch 32", "b": "r1s5", "kind_b": "AMD EPYC avx512_bf16, 2 threads, bf16, "
                                     "torch 2.13.0, eval batch 32"}]
    text = (tmp_path / "out" / "contrasts.md").read_text()
    assert "- cut 8 -> 1, seed 5: r8s5 on AMD EPYC avx2, 2 threads, fp32, torch 2.13.0, eval batch 32; r1s5 on AMD " \
           "EPYC avx512_bf16, 2 threads, bf16, torch 2.13.0, eval batch 32" in text
    # with the seeds declared, the refused pair's seed is missing: no verdict on fewer than the plan's seeds
    (tmp_path / "plan.yaml").write_text(PLAN + "seeds: [0, 1, 2, 3, 4, 5]\n")
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out2"), "--plan",
                        str(tmp_path / "plan.yaml")]) == 0
    text = (tmp_path / "out2" / "contrasts.md").read_text()
    assert "| not run: 5 of the 6 declared seeds in both cells (missing 5); 1 pair(s) refused, their cells on " \
           "different run kinds (named below) |" in text


def _welch_record(folder: Path, r: int, seed: int, acc: float) -> None:
    folder.mkdir(parents=True)
    config = {"experiment": "unit", "seed": seed, "model": {"name": "m"}, "data": {"source": "bbc"},
              "adapter": {"attn": {"r": r}, "mlp": {"r": r}}}
    (folder / "result.json").write_text(json.dumps({
        "status": "ok", "config": config, "config_hash": f"{r}{seed}", "seed": seed,
        "trainable_params": {"total": 10 * r, "per_layer_type": {"attn": 4 * r, "mlp": 6 * r}},
        "final_accuracy": {"test": acc, "val": acc}, "train_tokens_per_second": 1.0, "execution": BF16}))


CONTROLLED = """controls:
  - {name: all 8 -> 1, a: {attn_r: 8}, b: {attn_r: 1}}
margin: {relative_to: all 8 -> 1, factor: 0.25}
contrasts:
  - {name: 4 vs 8, a: {attn_r: 4}, b: {attn_r: 8}}
"""


@pytest.mark.parametrize("cut", [[0.70, 0.72, 0.74], [0.90, 0.92, 0.91]])
def test_a_positive_control_is_judged_first_and_sets_the_margin(tmp_path, capsys, cut):
    """The control must come out "differs"; the margin is 0.25 x its measured cost, printed with its source, and only
    from a control that passed: a control that cannot be seen sets no margin, so nothing is called "equivalent"."""
    accs = {8: [0.90, 0.91, 0.92], 4: [0.895, 0.905, 0.915], 1: cut}
    for r, values in accs.items():
        for seed, acc in enumerate(values):
            _welch_record(tmp_path / "runs" / f"r{r}s{seed}", r, seed, acc)
    (tmp_path / "plan.yaml").write_text(CONTROLLED)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--plan",
                        str(tmp_path / "plan.yaml")]) == 0
    main, control = json.loads((tmp_path / "out" / "contrasts.json").read_text())
    cost = np.mean(accs[8]) - np.mean(cut)
    assert control["name"] == "all 8 -> 1" and control["control"] and control["diff"] == pytest.approx(cost)
    control_p = stats.welch(accs[8], cut).p  # one control: Holm leaves its p as it is
    assert control["p_adj"] == pytest.approx(control_p)
    text = (tmp_path / "out" / "contrasts.md").read_text()
    assert capsys.readouterr().out.count("Positive controls (each must come out \"differs\"") == 1
    if control_p < 0.05:  # the steep cut: the control passes and sets the margin
        assert control["passed"] and f"| differs | passed |" in text
        margin = 0.25 * cost
        assert f"Margin: ±{margin:.4g} (0.25 x the measured cost of control 'all 8 -> 1' (|{cost:+.4f}|))." in text
        want = stats.welch(accs[4], accs[8], margin)
        assert main["margin"] == pytest.approx(margin) and main["p_tost"] == pytest.approx(want.p_tost)
        assert main["verdict"] == "equivalent" and f"| equivalent within ±{margin:g} |" in text
    else:  # no cost seen: the control fails, the margin is unresolved and no contrast is "equivalent"
        assert not control["passed"] and "| inconclusive | FAILED |" in text
        assert "Margin: unresolved (0.25 x the cost of control 'all 8 -> 1', which came out inconclusive; no " \
               "equivalence verdicts)." in text
        assert main["margin"] == 0 and main["verdict"] == "inconclusive" and "margin unresolved" in text
    assert main["margin_source"] in text


@pytest.mark.parametrize("plan, line", [
    ("controls: [{name: c, a: {attn_r: 8}, b: {attn_r: 1}}]\nmargin: {relative_to: nope, factor: 0.25}\n",
     "margin.relative_to='nope': not a declared control; allowed: 'c'"),
    ("margin: {relative_to: c, factor: 0.25}\n",
     "margin.relative_to='c': not a declared control; allowed: none (the plan declares no controls)"),
    ("controls: [{name: c, a: {attn_r: 8}, b: {attn_r: 1}}]\nmargin: {relative_to: c, factor: 2}\n",
     "margin.factor=2: a number > 0 and <= 1 (the share of the control's measured cost)"),
    ("controls: [{name: c, a: {attn_r: 8}, b: {attn_r: 1}}]\nmargin: {relative_to: c, factor: yes}\n",
     "margin.factor=True: a number > 0 and <= 1 (the share of the control's measured cost)"),
    ("controls: [{name: c, a: {attn_r: 8}, b: {attn_r: 1}}]\nmargin: {relative_to: c}\n",
     "margin={'relative_to': 'c'}: a number > 0, or {relative_to: CONTROL, factor: F} (no other keys)"),
    ("margin: -0.1\n", "margin=-0.1: a number > 0, or {relative_to: CONTROL, factor: F}"),
    ("margin: 0.25 x control\n", "margin='0.25 x control': a number > 0, or {relative_to: CONTROL, factor: F}"),
    ("controls: [{name: c, a: {attn_r: 8}}]\n", "controls must be a list of {name, a, b} with a and b as column: "
                                                "value maps"),
    ("controls: [{name: x, a: {attn_r: 8}, b: {attn_r: 1}}]\n",
     "controls=['x']: each control needs a name no other control or contrast has"),
])
def test_a_bad_plan_is_one_line_and_exit_2_before_anything_is_written(tmp_path, capsys, plan, line):
    _welch_record(tmp_path / "runs" / "r8s0", 8, 0, 0.9)
    (tmp_path / "plan.yaml").write_text("contrasts: [{name: x, a: {attn_r: 8}, b: {attn_r: 1}}]\n" + plan)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--plan",
                        str(tmp_path / "plan.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"qft.tools.report: error: --plan={tmp_path / 'plan.yaml'}: {line}"]
    assert not (tmp_path / "out").exists()
