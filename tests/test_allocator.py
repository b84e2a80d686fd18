"""The fitted budget allocator (qft.budget.fit / propose / method=uniform|fitted): coefficients recovered from
synthetic records, the proposal is the brute-force argmax within tolerance and the measured ranks, bad input is
refused naming the key, and on the committed BBC News records the CLI proposes ranks that meet the budget."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qft import data, budget, layers as L, model, record
from qft.errors import QftError
from conftest import make_cfg

ROOT = Path(__file__).resolve().parent.parent
TRUE = np.array([0.60, 0.05, 0.08, -0.012])  # c, u, v, w of budget.FORM
NOISE = 0.005
# one attention and one MLP projection: 100 and 160 parameters per unit of rank
LAYERS = [L.Layer("layers.0.self_attn.q_proj", "attn", "q_proj", 0, 60, 40),
          L.Layer("layers.0.mlp.up_proj", "mlp", "up_proj", 0, 100, 60)]


def synthetic(ranks=(0, 1, 2, 4, 8), seeds=4, coef=TRUE, noise=NOISE, source="synth", rng_seed=0) -> pd.DataFrame:
    """Records as qft.tools.report.collect returns them, accuracy drawn from known coefficients plus noise."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for a in ranks:
        for m in ranks:
            for s in range(seeds):
                acc = 0.2 if a == m == 0 else float(budget.features(a, m) @ coef + rng.normal(0, noise))
                rows.append({"status": "ok", "attn_r": a, "mlp_r": m, "seed": s, "acc_test": acc,
                             "cfg.data.source": source, "cfg.model.name": "m"})
    return pd.DataFrame(rows)


def write_record(folder: Path, source: str, attn_r: int, mlp_r: int, seed: int, acc: float, status="ok",
                 model_name="tiny_llama") -> None:
    """A minimal result record, as tests/test_sweep.py writes them: what qft.tools.report.collect reads."""
    folder.mkdir(parents=True)
    config = {"experiment": "unit", "seed": seed, "model": {"name": model_name}, "data": {"source": source},
              "adapter": {"attn": {"r": attn_r, "alpha": 16}, "mlp": {"r": mlp_r, "alpha": 16}}}
    (folder / "result.json").write_text(json.dumps({
        "status": status, "config": config, "config_hash": f"{source}{attn_r}{mlp_r}{seed}", "seed": seed,
        "trainable_params": {"total": 0, "per_layer_type": {}}, "final_accuracy": {"test": acc, "val": acc}}))


def write_records(root: Path, df: pd.DataFrame) -> Path:
    for i, r in df.iterrows():
        write_record(root / f"{r['cfg.data.source']}-{i}", r["cfg.data.source"], int(r.attn_r), int(r.mlp_r),
                     int(r.seed), float(r.acc_test))
    return root


def test_fit_recovers_the_generating_coefficients_within_their_standard_errors():
    df = synthetic()
    f = budget.fit(df)
    assert f.n_zero_shot == 4 and f.n_records == len(df) - 4 and f.n_cells == 24  # zero-shot cell left out
    assert f.dof == f.n_records - 4 and f.data == "synth" and f.measured == {"attn": 8, "mlp": 8}
    assert np.all(np.abs(f.coef - TRUE) <= 3 * f.se), (f.coef, f.se)
    assert np.all(f.se < 0.01)
    # the SEs are the real spread of the estimates: over fresh noise draws, the estimates scatter by the SE
    draws = [budget.fit(synthetic(rng_seed=k)) for k in range(1, 61)]
    spread, mean_se = np.std([d.coef for d in draws], axis=0), np.mean([d.se for d in draws], axis=0)
    assert np.all((0.7 < spread / mean_se) & (spread / mean_se < 1.3)), (spread, mean_se)
    inside = np.mean([np.abs(d.coef - TRUE) <= 2 * d.se for d in draws], axis=0)
    assert np.all(inside >= 0.85), inside
    assert 0.7 * NOISE < f.resid_se < 1.3 * NOISE and 0.7 * NOISE < f.pure_sd < 1.3 * NOISE
    mean, half = f.predict(2, 4)
    assert abs(mean - budget.features(2, 4) @ TRUE) < half < 0.01
    # the difference's interval uses the shared covariance: identical ranks differ by exactly 0 +- 0
    assert f.difference((3, 3), (3, 3)) == (0.0, 0.0)


def test_fit_refuses_too_few_cells_too_few_records_and_unidentifiable_grids():
    with pytest.raises(QftError) as e:  # 3 fine-tuned cells for 4 coefficients
        budget.fit(synthetic(ranks=(0, 2)))
    assert e.value.key == "budget.records" and "at least 4 distinct" in str(e.value)
    with pytest.raises(QftError) as e:  # enough cells, but only the attention rank varies with the MLP at 0
        budget.fit(synthetic(ranks=(0, 1, 2, 4, 8)).query("mlp_r == 0"))
    assert e.value.key == "budget.records"
    with pytest.raises(QftError) as e:  # 4 cells, one seed each: no degree of freedom for the noise
        df = synthetic(ranks=(0, 2, 8), seeds=1)
        budget.fit(df[[(a, m) in {(0, 2), (2, 0), (2, 2), (8, 8)} for a, m in zip(df.attn_r, df.mlp_r)]])
    assert e.value.key == "budget.records" and "more records" in str(e.value)


def test_fit_of_mixed_datasets_needs_a_choice():
    df = pd.concat([synthetic(source="bbc_news"), synthetic(source="reuters_r8", coef=TRUE * 0.5, rng_seed=1)])
    with pytest.raises(QftError) as e:
        budget.fit(df)
    assert e.value.key == "budget.records_data" and "bbc_news, reuters_r8" in str(e.value)
    with pytest.raises(QftError) as e:
        budget.fit(df, "twenty_newsgroups")
    assert e.value.key == "budget.records_data"
    assert np.allclose(budget.fit(df, "bbc_news").coef, budget.fit(synthetic(source="bbc_news")).coef)


@pytest.mark.parametrize("params,tolerance", [(900, 0.02), (1500, 0.05), (1900, 0.1), (2000, 0.02)])
def test_propose_is_the_brute_force_argmax_within_tolerance_and_the_measured_ranks(params, tolerance):
    f = budget.fit(synthetic())
    p = budget.propose(f, LAYERS, params, tolerance)
    best = max(((a, m) for a in range(9) for m in range(9)
                if (a or m) and 0 <= params - (100 * a + 160 * m) <= tolerance * params),
               key=lambda am: f.predict(*am)[0])
    assert (p.best["attn"], p.best["mlp"]) == best
    assert p.best["params"] == 100 * best[0] + 160 * best[1]
    assert 0 <= params - p.best["params"] <= tolerance * params  # never above the budget
    assert all(-tolerance <= c["off_by"] <= 0 for c in p.candidates)
    assert p.candidates[0] is p.best and [c["pred"] for c in p.candidates] == sorted((c["pred"] for c in p.candidates), reverse=True)
    # the uniform allocation: the same rank on both types, nearest the budget
    r = p.uniform["attn"]
    assert p.uniform["mlp"] == r and all(abs(260 * r - params) <= abs(260 * k - params) for k in range(1, 30))
    diff, half = f.difference((p.best["attn"], p.best["mlp"]), (r, r))
    assert (p.diff, p.diff_ci) == ((diff, half) if (p.best["attn"], p.best["mlp"]) != (r, r) else (0.0, 0.0))


def test_uniform_has_equal_ranks_within_tolerance_or_is_refused():
    cfg = make_cfg("budget=shares", "budget.params=1040", "budget.method=uniform", "budget.tolerance=0.02").budget
    assert budget.solve(LAYERS, cfg) == {"attn": 4, "mlp": 4}  # 4 x 260 = 1040
    f = budget.fit(synthetic())
    u = budget.propose(f, LAYERS, 1040, 0.02).uniform
    assert (u["attn"], u["mlp"], u["params"]) == (4, 4, 1040) and abs(u["off_by"]) <= 0.02
    cfg.params = 1170  # between rank 4 (1040) and rank 5 (1300): 11% away either way
    with pytest.raises(QftError) as e:
        budget.solve(LAYERS, cfg)
    assert e.value.key == "budget.params" and "uniform" in str(e.value)


def test_max_rank_blocks_extrapolation():
    f = budget.fit(synthetic(ranks=(0, 1, 2, 4)))
    assert f.measured == {"attn": 4, "mlp": 4}
    p = budget.propose(f, LAYERS, 1040, 0.05)
    assert all(c["attn"] <= 4 and c["mlp"] <= 4 and not c["extrapolates"] for c in p.candidates)
    with pytest.raises(QftError) as e:  # 2,000 needs more than rank 4 on both types (4 x 260 = 1,040)
        budget.propose(f, LAYERS, 2000, 0.02)
    assert e.value.key == "budget.params" and "budget.max_rank" in str(e.value)
    wide = budget.propose(f, LAYERS, 2000, 0.02, max_rank=16)
    assert wide.best["extrapolates"] and "extrapolates" in wide.describe()


def test_the_verdict_says_plainly_when_the_difference_is_within_noise():
    flat = budget.propose(budget.fit(synthetic(coef=np.array([0.8, 0.001, 0.0015, 0.0]), noise=0.03)), LAYERS, 1040, 0.05)
    assert flat.within_noise and "WITHIN NOISE" in flat.describe()
    steep = budget.propose(budget.fit(synthetic(coef=np.array([0.3, 0.01, 0.12, 0.0]), noise=0.002)), LAYERS, 1040, 0.05)
    assert not steep.within_noise and steep.diff > steep.diff_ci > 0
    assert "WITHIN NOISE" not in steep.describe() and "favours the fitted allocation" in steep.describe()


def test_a_fitted_budget_sets_the_runs_ranks_from_the_records(tmp_path):
    records = write_records(tmp_path / "runs", synthetic())
    cfg = make_cfg("budget=fitted", "budget.params=20000", f"budget.records={records}", "budget.tolerance=0.05")
    budget.check(cfg.budget)
    layers = budget.meta_layers(model.resolve(cfg.model, cfg.cache_dir))  # tiny_llama: 1,792 / 2,688 a rank
    ranks = budget.apply(cfg, layers)
    best = budget.propose(budget.fit_records(cfg.budget), layers, 20000, 0.05).best
    assert ranks == {"attn": best["attn"], "mlp": best["mlp"]} == {"attn": cfg.adapter.attn.r, "mlp": cfg.adapter.mlp.r}
    assert abs(1792 * ranks["attn"] + 2688 * ranks["mlp"] - 20000) <= 0.05 * 20000


def test_bad_budget_methods_and_records_are_refused_naming_the_key(tmp_path):
    def refused(*overrides):
        with pytest.raises(QftError) as e:
            budget.check(make_cfg("budget=shares", "budget.params=20000", *overrides).budget)
        return e.value

    assert refused("budget.method=greedy").key == "budget.method"
    assert refused("budget.method=fitted").key == "budget.records"
    assert refused("budget.method=fitted", f"budget.records={tmp_path / 'nowhere'}").key == "budget.records"
    write_record(tmp_path / "failed" / "a", "bbc_news", 2, 2, 0, 0.5, status="failed")
    e = refused("budget.method=fitted", f"budget.records={tmp_path / 'failed'}")
    assert e.key == "budget.records" and "no ok result record" in str(e)
    mixed = write_records(tmp_path / "mixed", pd.concat([synthetic(source="bbc_news"),
                                                           synthetic(source="reuters_r8")], ignore_index=True))
    assert refused("budget.method=fitted", f"budget.records={mixed}").key == "budget.records_data"
    assert refused("budget.method=fitted", f"budget.records={mixed}", "budget.split=depth").key == "budget.split"
    budget.check(make_cfg("budget=shares", "budget.params=20000", "budget.method=fitted", f"budget.records={mixed}",
                          "budget.records_data=reuters_r8").budget)
    budget.check(make_cfg("budget=shares", "budget.method=greedy").budget)  # no budget.params: off
    res = subprocess.run([sys.executable, "-m", "qft.budget", "model=tiny_llama", "budget.params=20000",
                          "budget.method=greedy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "qft.budget: error: budget.method='greedy': allowed: shares, uniform, fitted"]


def test_committed_records_recompute_their_hash_and_older_data_formats_are_never_reused():
    recs = [json.loads(p.read_text()) for p in (ROOT / "results").rglob("result.json")]
    recs = [r for r in recs if "config" in r]
    assert recs and all(record.config_hash(r["config"], inputs_=r.get("inputs") or {}) == r["config_hash"]
                        for r in recs if r.get("schema", 1) >= 2)
    old = [r for r in recs if "inputs" not in r]  # made with data format 1, whose prompts told the label
    fresh = {"data_format": data.FORMAT}
    assert old and all(record.config_hash(r["config"], inputs_=fresh) != r["config_hash"] for r in old)
    assert record.config_hash(make_cfg()) == record.config_hash(make_cfg("budget=fitted", "budget.max_rank=4"))


@pytest.mark.parametrize("params", [1146000, 2292000])
def test_cli_proposes_ranks_within_tolerance_on_the_committed_bbc_records(params, monkeypatch, capsys):
    """qft.budget's main in this process (test_bad_budget_methods_and_records_are_refused_naming_the_key runs it as a
    process)."""
    from qft.budget.cli import main

    monkeypatch.chdir(ROOT)
    status = main(["model=smollm2_135m", f"budget.params={params}", "budget.method=fitted",
                   "budget.records=results/rank_sweep/runs", "budget.records_data=bbc_news"])
    got = capsys.readouterr()
    assert status == 0, got.err[-2000:]
    out = got.out
    assert "of bbc_news under results/rank_sweep/runs" in out and "| w |" in out and "residual SE" in out
    fitted = re.search(r"^\| fitted(?: = uniform)? \| (\d+) \| (\d+) \| ([\d,]+) \| ([+-][\d.]+)% \|", out, re.M)
    assert fitted, out
    a, m, count = int(fitted.group(1)), int(fitted.group(2)), int(fitted.group(3).replace(",", ""))
    assert count == 115200 * a + 190080 * m and abs(count - params) <= 0.02 * params
    assert a <= 8 and m <= 8  # the largest rank the sweep measured
    assert "predicted difference, fitted - uniform" in out or "uniform allocation itself" in out


def bits_records(means: dict, spread=0.01) -> pd.DataFrame:
    """A bits sweep's records: per (attn bits, mlp bits) two adapter configurations x 3 seeds around a mean."""
    rows = []
    for (ab, mb), mean in means.items():
        for adapter_r in ((8, 8), (3, 8)):
            for s, d in enumerate((-spread, 0.0, spread)):
                rows.append({"status": "ok", "attn_r": adapter_r[0], "mlp_r": adapter_r[1], "seed": s,
                             "acc_test": mean + d, "attn_bits": ab, "mlp_bits": mb, "cfg.data.source": "r8",
                             "base_bytes": 1000 * (ab + mb)})
    return pd.DataFrame(rows)


def test_bits_proposal_is_the_smallest_base_within_the_noise_of_the_best():
    df = bits_records({(4, 4): 0.70, (8, 8): 0.80, (16, 16): 0.805})
    # an adapter measured at one setting only is no like-for-like evidence: left out of the pooling
    df = pd.concat([df, pd.DataFrame([{**df.iloc[-1].to_dict(), "attn_r": 2, "mlp_r": 2, "acc_test": 0.1}])])
    p = budget.propose_bits(df)
    assert [(r["attn"], r["mlp"], r["n"]) for r in p.table] == [(4, 4, 6), (8, 8, 6), (16, 16, 6)]
    assert (p.best["attn"], p.chosen["attn"]) == (16, 8) and p.adapters == 2
    # 4-bit: 0.105 below the best with sd 0.011 over 6 records each: far beyond the noise
    four = p.table[0]
    assert four["diff"] == pytest.approx(-0.105) and four["verdict"] == "differs"
    assert p.table[1]["verdict"] == "equivalent"  # 8-bit: -0.005, shown within ±0.02 (TOST), not merely "no star"
    assert "proposed bits: attn 8, mlp 8" in p.describe() and "2.00x smaller" in p.describe()
    p = budget.propose_bits(bits_records({(4, 4): 0.795, (8, 8): 0.80}))
    assert (p.chosen["attn"], p.chosen["mlp"]) == (4, 4)
    with pytest.raises(QftError, match="budget.bits_records"):
        budget.propose_bits(bits_records({(4, 4): 0.7}))


def test_bits_records_key_changes_no_run_hash():
    cfg = {"seed": 0, "budget": {"params": 1000, "bits_records": None}}
    assert record.config_hash(cfg) == record.config_hash({**cfg, "budget": {**cfg["budget"], "bits_records": "x"}})
