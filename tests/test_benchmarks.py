"""The benchmark tools measure what they say: speed.py's steady rate, and step_ops.py's table of a real step."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import speed  # noqa: E402


def test_steady_rate_leaves_the_first_step_out_and_takes_the_median_step():
    # 4 steps of 1,000 tokens in all: the first ends at 10 s (start-up work), then steps of 1, 3 and 1 s
    assert speed.steady(1000, [10.0, 11.0, 14.0, 15.0]) == pytest.approx(250 / 1.0)
    with pytest.raises(statistics.StatisticsError):
        speed.steady(1000, [10.0])  # one step has no steady rate


def test_paired_ratios_divide_within_each_repetition_in_order():
    """The host's pace drifts between repetitions: a rep's qft run is divided by that rep's stock run, not by the
    other rep's, whichever order the runs were listed in."""
    runs = [{"rep": 1, "kind": "baseline", "tps": 300.0}, {"rep": 0, "kind": "qft", "tps": 400.0},
            {"rep": 0, "kind": "qft_also", "tps": 500.0}, {"rep": 0, "kind": "baseline", "tps": 200.0},
            {"rep": 1, "kind": "qft", "tps": 600.0}]
    assert speed.paired_ratios(runs, "tps") == [2.0, 2.0]
    assert speed.paired_ratios(runs, "tps", "qft_also", "qft") == [1.25]  # rep 1 has no qft_also run
    with pytest.raises(KeyError):
        speed.paired_ratios(runs[1:], "tps")  # rep 1 lost its stock run: no silent pairing with rep 0's


def test_an_invocation_whose_qft_runs_read_different_sources_says_so():
    """The checkout edited between two qft runs (a session editing qft/ beside a benchmark did, twice): each run's
    record names the source it imported, and the invocation lists them all; the stock recipe's runs have none."""
    runs = [{"kind": "qft", "qft_source": "aaa"}, {"kind": "baseline"}, {"kind": "qft_also", "qft_source": "aaa"}]
    assert speed.code_versions(runs) == ["aaa"]
    speed.one_source(["aaa"], "x")  # one known source: no exit
    edited = speed.code_versions([*runs, {"kind": "qft", "qft_source": "bbb"}])
    assert edited == ["aaa", "bbb"]
    for sources in (edited, [None], speed.code_versions([*runs, {"kind": "qft"}])):
        with pytest.raises(SystemExit, match="did not all read one known source") as e:
            speed.one_source(sources, "speed-x")
        assert "speed-x.json" in str(e.value)


def test_result_names_tell_cpu_kinds_and_switches_apart():
    a = speed.argparse.Namespace(seq=64, steps=10, baseline_dtype="fp32", unfused=True, also=["adapter.shared_dropout=true"],
                                 qft_overrides=["quant.compute_dtype=fp32"])
    assert speed.result_name(a, "amx_bf16", {}) == (
        "speed-seq64-steps10-baseline_fp32-unfused-also-adapter.shared_dropout_true-quant.compute_dtype_fp32-amx_bf16")
    capped = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert speed.result_name(a, "avx512_bf16", capped).endswith("-avx512_bf16-capped_avx2")
    a.unfused, a.also, a.qft_overrides = False, [], []
    assert speed.result_name(a, "avx2", {}) == "speed-seq64-steps10-baseline_fp32-avx2"


def step_ops(*args):
    return subprocess.run([sys.executable, "benchmarks/step_ops.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.reproduce  # a benchmark tool measuring real steps end to end (make reproduce)
def test_step_ops_times_every_op_of_a_real_step():
    out = step_ops("--batch", "4", "--seq", "64", "--warmup", "1", "--steps", "2", "--top", "500", "--split",
                   "aten._to_copy", "model=tiny_llama", "quant.compute_dtype=bf16")
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| `([^`]+)` \| ([\d.]+) \| ([\d.]+)% \| (\d+) \|$", out.stdout, re.M)
    ops = {name: (float(ms), float(share), int(calls)) for name, ms, share, calls in rows}
    timed, in_ops = map(float, re.search(r"a step: ([\d.]+) s timed, ([\d.]+) s in ops", out.stdout).groups())
    assert 0 < in_ops <= timed
    # every op, each once: the rows add up to the time in ops, within the printed rounding (0.005 ms a row)
    assert sum(ms for ms, _, _ in ops.values()) == pytest.approx(1e3 * in_ops, abs=0.05 + 0.005 * len(ops))
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu_backward"][2] == 4  # tiny_llama: 4 layers
    # one fast dropout mask per adapted projection, drawn, applied and undone by compiled loops (accel.compiled_masks)
    assert ops["qft.accel.kernels.random_bits"][2] == ops["qft.accel.kernels.drop"][2] == 4 * 7
    assert ops["qft.accel.kernels.undrop"][2] == 4 * 7 - 3  # layer 0's q/k/v read the embedding: no gradient
    assert ops["qft.accel.kernels.lora_sum"][2] == 4 * 7 and "aten.random_" not in ops  # bf16 attention: o sums in bf16
    assert ops["qft.accel.kernels.lora_sum_grad"][2] == 4 * 6
    assert ops["qft.accel.kernels.rope"][2] == 4 * 2 * 2 and "aten.neg" not in ops  # q and k, forward and backward
    assert any(re.fullmatch(r"aten\.mm \[\d+, \d+\] x \[\d+, \d+\]", name) for name in ops)  # matmuls by shape
    # --split keys the casts by operand and result: bf16 compute casts fp32 activations down and gradients up
    assert "aten._to_copy" not in ops
    assert any(re.fullmatch(r"aten\._to_copy float32\[4, \d+, \d+\] -> bfloat16", name) for name in ops)
    assert any(re.fullmatch(r"aten\._to_copy bfloat16\[4, \d+, \d+\] -> float32", name) for name in ops)


def test_step_ops_bad_input_exits_2_with_one_line():
    out = step_ops("--seq", "16", "model=tiny_llama")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1].startswith("step_ops.py: error: data.max_length=16")
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.reproduce  # a benchmark tool measuring real steps end to end (make reproduce)
@pytest.mark.parametrize("loops", ["masks", "sums", "rope", "rows"])
def test_compiled_alternates_the_switch_in_one_process(tmp_path, loops):
    out = subprocess.run([sys.executable, "benchmarks/compiled.py", "--loops", loops, "--batch", "4", "--warmup", "1",
                          "--pairs", "2", "--out", str(tmp_path), "model=tiny_llama"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (result,) = tmp_path.glob(f"compiled_{loops}-seq64*-model_tiny_llama-*.json")  # -threads1 under xdist
    got = json.loads(result.read_text())
    assert len(got["step_seconds"]["compiled"]) == len(got["step_seconds"]["torch_ops"]) == 2
    med = got["step_seconds_median"]
    assert got["ratio_compiled_over_torch_ops"] == pytest.approx(med["compiled"] / med["torch_ops"])
    assert f"the {loops} on" in out.stdout and f"ratio {got['ratio_compiled_over_torch_ops']:.3f}" in out.stdout


@pytest.mark.reproduce  # a benchmark tool measuring real steps end to end (make reproduce)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one usable core: one thread is the machine's count")
def test_compiled_names_a_thread_count_below_the_cores_in_its_file(tmp_path):
    """Runs at one thread (a study's setting) must not overwrite the same switch's file at the machine's count."""
    out = subprocess.run([sys.executable, "benchmarks/compiled.py", "--loops", "rope", "--batch", "4", "--warmup", "1",
                          "--pairs", "1", "--out", str(tmp_path), "model=tiny_llama"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    (result,) = tmp_path.glob("*.json")
    cpu_kind = json.loads(result.read_text())["settings"]["cpu_kind"]
    assert result.name == f"compiled_rope-seq64-threads1-model_tiny_llama-{cpu_kind}.json"


def test_compiled_masks_without_masks_exits_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/compiled.py", "--out", str(tmp_path), "model=tiny_llama",
                          "adapter.dropout_mask=torch"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and out.stdout == "" and not list(tmp_path.iterdir())
    assert out.stderr.strip().splitlines() == [out.stderr.strip().splitlines()[-1]]
    assert out.stderr.startswith("compiled.py: error: adapter.dropout_mask='torch'")


def test_compiled_sums_without_fusion_exits_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/compiled.py", "--loops", "sums", "--out", str(tmp_path),
                          "model=tiny_llama", "accel.fuse_projections=false"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2 and out.stdout == "" and not list(tmp_path.iterdir())
    assert out.stderr.strip().splitlines() == [out.stderr.strip().splitlines()[-1]]
    assert out.stderr.startswith("compiled.py: error: accel.fuse_projections=False")


def startup(tmp_path, *args):
    return subprocess.run([sys.executable, "benchmarks/startup.py", "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.reproduce  # a benchmark tool measuring real steps end to end (make reproduce)
def test_startup_times_later_runs_and_their_parts_against_another_checkout(tmp_path):
    out = startup(tmp_path, "--against", str(ROOT), "--pairs", "1", "--probes", "2", "model=tiny_llama")
    assert out.returncode == 0, out.stderr
    (result,) = tmp_path.glob("startup-against-model_tiny_llama-*.json")
    got = json.loads(result.read_text())
    assert set(got["runs"]) == {"this", "against"} and got["settings"]["trees"] == {"this": ".", "against": "."}
    assert got["settings"]["code"]["this"] == got["settings"]["code"]["against"]  # one checkout: one source
    assert len(got["settings"]["code"]["this"]["qft_source"]) == 16
    for proc in got["runs"]["this"] + got["runs"]["against"]:
        assert len(proc) == 2
        for probe in proc:  # the parts and the rest make up the whole; the timed qft functions ran
            assert sum(v for k, v in probe.items() if k != "total") == pytest.approx(probe["total"])
            assert all(probe[p] > 0 for p in ("compose", "data", "load", "quantize", "adapters (peft)"))
    med = got["median_seconds"]
    assert got["pair_ratios"] == [pytest.approx(med["this"]["total"] / med["against"]["total"])]
    assert f"| total | {med['this']['total']:.3f} | {med['against']['total']:.3f} |" in out.stdout


def test_startup_bad_input_exits_2_with_one_line(tmp_path):
    out = startup(tmp_path, "--pairs", "1", "--probes", "1", "model=tiny_llama", "data.max_length=16")
    assert out.returncode == 2 and out.stdout == "" and not list(tmp_path.iterdir())
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("startup.py: error: data.max_length=16")
    out = startup(tmp_path, "--against", str(tmp_path))
    assert out.returncode == 2 and "--against" in out.stderr.strip().splitlines()[-1]


def test_ratio_bound_is_the_stock_pace_against_qfts_flops_at_the_matmul_rate(tmp_path):
    """1,024 qft tokens a step; the stock recipe at 100 tokens/s steady (10.24 s a step); qft's useful FLOPs at a
    200 GFLOP/s fp32 rate take F / 200e9 s, so qft there would be 10.24 / (F / 200e9) times the stock recipe."""
    assert sum(4 * i * o for i, o in speed.SHAPES) == 14_155_776  # SmolLM2-135M's seven frozen projections a token
    summary = {"settings": {"seq": 64, "batch": 16, "steps": 2, "baseline_dtype": "bf16"},
               "runs": [{"kind": "qft", "train_tokens": 2048}, {"kind": "baseline", "train_tokens": 1000}],
               "steady_tokens_per_second": {"baseline": 100.0, "ratio_qft_over_baseline": 1.5},
               "tokens_per_second": {"baseline": 80.0, "ratio_qft_over_baseline": 1.4},
               "matmul_ceiling_gflops": {"bf16": 5.0, "fp32": 200.0}, "qft_compute_dtype": "fp32",
               "step_shape_matmul_gflops": 150.0}
    layer = 14_155_776 + sum(6 * 8 * (i + o) for i, o in speed.SHAPES) + 3 * 4 * 32 * 576  # frozen, LoRA, attention
    head = 4 * 576 * 49152  # forward and input gradient, a position
    flops = 30 * layer * 1024 + head * 16 * 1.2  # qft: the head at 1.2 answer tokens an example
    b = speed.ratio_bound(summary)
    assert b["at_ceiling"] == pytest.approx(10.24 / (flops / 200e9))
    assert b["at_step_shapes"] == pytest.approx(10.24 / (flops / 150e9))
    stock_flops = 30 * layer * 1024 + head * 1024  # the stock recipe: the head at every position
    assert b["flops_ratio"] == pytest.approx(stock_flops / flops) and 1.2 < b["flops_ratio"] < 1.3
    assert b["stock_mfu"] == pytest.approx(stock_flops / 10.24 / 5e9)  # its own dtype's rate (bf16 here)
    assert (b["stock_pace"], b["qft_ratio"]) == ("steady_tokens_per_second", 1.5)
    del summary["steady_tokens_per_second"], summary["step_shape_matmul_gflops"]  # a file before steady rates
    b = speed.ratio_bound(summary)
    assert b["at_ceiling"] == pytest.approx(1024 / (flops / 200e9) / 80.0)
    assert "at_step_shapes" not in b and b["stock_pace"] == "tokens_per_second"
    committed = ROOT / "benchmarks" / "results" / "speed-seq64-baseline_fp32.json"  # the AVX2-only CPU, 2026-12-02
    ok = subprocess.run([sys.executable, "benchmarks/speed.py", "--read", str(committed), "--target", "1.6"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and re.search(r"qft would be 2\.07x; 1\.25x where both", ok.stdout), ok.stdout
    # a file from before runs carried their repetition: each kind's n-th run is repetition n
    assert "each repetition 1.14, 1.17: 1.07-1.25 (90% interval, 2 repetitions); target 1.6x: short" in ok.stdout
    empty = json.loads(committed.read_text())
    empty["runs"] = []
    (tmp_path / "empty.json").write_text(json.dumps(empty))
    (tmp_path / "x.json").write_text("{}")
    for f in ("x.json", "missing.json", "empty.json"):
        r = subprocess.run([sys.executable, "benchmarks/speed.py", "--read", str(tmp_path / f)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--read" in r.stderr, r.stderr


def test_runs_of_old_files_are_numbered_by_repetition_in_the_order_they_ran():
    runs = [{"kind": "qft", "v": 1}, {"kind": "qft_also", "v": 2}, {"kind": "baseline", "v": 3},
            {"kind": "qft", "v": 4}, {"kind": "qft_also", "v": 5}, {"kind": "baseline", "v": 6}]
    assert [(r["rep"], r["v"]) for r in speed.numbered(runs)] == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (1, 6)]
    assert speed.paired_ratios(speed.numbered(runs), "v", "qft_also", "qft") == [2.0, 1.25]
    assert speed.numbered([{"kind": "qft", "rep": 7}])[0]["rep"] == 7  # a run's own repetition stands


def test_a_target_is_judged_on_the_repetitions_interval():
    """Log ratios 0.7, 0.8, 0.9 (mean 0.8, sd 0.1): the 90% t-interval with 2 degrees of freedom is
    exp(0.8 -+ 2.919986 * 0.1 / sqrt(3)); a target inside it is unresolved, below it met, above it short."""
    import math

    from scipy import stats

    ratios = [math.exp(x) for x in (0.7, 0.8, 0.9)]
    half = stats.t.ppf(0.95, 2) * 0.1 / math.sqrt(3)
    assert stats.t.ppf(0.95, 2) == pytest.approx(2.919986)
    ci = speed.ratio_interval(ratios, 2.2)
    assert ci["geometric_mean"] == pytest.approx(math.exp(0.8))
    assert (ci["low"], ci["high"]) == (pytest.approx(math.exp(0.8 - half)), pytest.approx(math.exp(0.8 + half)))
    assert ci["verdict"] == "unresolved"  # 1.88-2.63 holds 2.2
    assert speed.ratio_interval(ratios, 1.8)["verdict"] == "met"
    assert speed.ratio_interval(ratios, 2.7)["verdict"] == "short"
    assert speed.ratio_interval(ratios, ci["low"])["verdict"] == "met"  # a lower end on the target meets it
    one = speed.ratio_interval([2.5], 2.2)
    assert (one["low"], one["verdict"]) == (None, "unresolved")  # one repetition says nothing of the spread
