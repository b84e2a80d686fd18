"""qft.stats against scipy, statsmodels and hand computation, and its intervals' coverage in simulated studies."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

from qft import stats
from qft.errors import QftError

ROOT = Path(__file__).resolve().parent.parent


def test_welch_uses_the_exact_satterthwaite_degrees_of_freedom():
    a, b = [0.71, 0.74, 0.70], [0.66, 0.72, 0.61, 0.69]
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 4
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)  # by hand
    c = stats.welch(a, b)
    assert c.df == pytest.approx(df, rel=1e-12) and not float(c.df).is_integer()
    ci = st.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (c.low, c.high) == pytest.approx((ci.low, ci.high), rel=1e-12)
    assert c.p == pytest.approx(st.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-12)


def test_holm_on_a_known_p_vector():
    cs = [stats._finish(0.01, 0.01, 10, 0.02, "x", 3) for _ in range(4)]
    for c, p in zip(cs, [0.01, 0.04, 0.03, 0.005]):
        c.p = c.p_tost = p
    stats.holm(cs)
    assert [c.p_adj for c in cs] == pytest.approx([0.03, 0.06, 0.06, 0.02])  # 4p, 3p, 2p, 1p, kept monotone


def test_one_seed_is_the_paired_t_test_and_its_tost_is_statsmodels():
    from statsmodels.stats.weightstats import ttost_paired

    rng = np.random.default_rng(0)
    a, b = rng.normal(0.5, 1, 60), rng.normal(0.45, 1, 60)
    c = stats.paired(a, b, margin=0.3)
    ref = st.ttest_rel(a, b)
    assert c.p == pytest.approx(ref.pvalue, rel=1e-10) and c.df == 59
    assert c.p_tost == pytest.approx(ttost_paired(a, b, -0.3, 0.3)[0], rel=1e-10)


def test_crossed_mean_squares_equal_a_two_way_anova():
    import pandas as pd
    import statsmodels.formula.api as smf
    from statsmodels.stats.anova import anova_lm

    rng = np.random.default_rng(1)
    d = rng.normal(0, 1, (3, 12)) + rng.normal(0, 0.5, (3, 1)) + rng.normal(0, 0.8, (1, 12))
    frame = pd.DataFrame([(s, i, d[s, i]) for s in range(3) for i in range(12)], columns=["seed", "ex", "d"])
    table = anova_lm(smf.ols("d ~ C(seed) + C(ex)", frame).fit())
    ms = table["mean_sq"]
    ms_s, ms_i, ms_e = ms["C(seed)"], ms["C(ex)"], ms["Residual"]
    mean, se, df, comp = stats.crossed(d)
    assert mean == pytest.approx(d.mean())
    assert se == pytest.approx(math.sqrt((ms_s + ms_i - ms_e) / 36), rel=1e-10)
    want_df = (ms_s + ms_i - ms_e) ** 2 / (ms_s ** 2 / 2 + ms_i ** 2 / 11 + ms_e ** 2 / 22)
    assert df == pytest.approx(want_df, rel=1e-10)
    assert comp["seed"] == pytest.approx((ms_s - ms_e) / 12) and comp["residual"] == pytest.approx(ms_e)


def simulated_study(rng, seeds=3, examples=200, delta=0.03, binary=True):
    """Two configurations on the same examples and seeds: example difficulty shared, example x configuration and
    seed x configuration effects of their own; the population difference is exactly delta."""
    if binary:
        q = rng.uniform(0.25, 0.75, examples)
        b = rng.uniform(-0.15, 0.15, examples)
        u = rng.normal(0, 0.02, (2, seeds, 1))
        pa, pb = q + delta / 2 + b / 2 + u[0], q - delta / 2 - b / 2 + u[1]
        return rng.random((seeds, examples)) < pa, rng.random((seeds, examples)) < pb
    q = rng.normal(-1.0, 1.0, examples)  # the gold label's log-likelihood
    b = rng.normal(0, 0.3, examples)
    u = rng.normal(0, 0.05, (2, seeds, 1))
    noise = rng.normal(0, 0.4, (2, seeds, examples))
    return q + delta / 2 + b / 2 + u[0] + noise[0], q - delta / 2 - b / 2 + u[1] + noise[1]


@pytest.mark.reproduce  # simulated studies: the test's size or coverage (make reproduce)
@pytest.mark.parametrize("binary,delta", [(True, 0.03), (True, 0.0), (False, 0.05)])
def test_paired_intervals_cover_a_known_effect(binary, delta, monkeypatch):
    """Never anticonservative (>= 0.93); at 3 seeds the seed mean square has 2 degrees of freedom, so where seed
    noise is small the interval is conservative (0.97-0.98 measured here), the price of not under-covering (0.92)
    where it is large."""
    monkeypatch.setattr(stats, "GPQ_DRAWS", 2000)  # the method, at a tenth of its draws: 1,000 studies stay fast
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(1000):
        a, b = simulated_study(rng, delta=delta, binary=binary)
        c = stats.paired(a, b)
        hits += c.low <= delta <= c.high
    assert 0.93 <= hits / 1000 <= 0.985, hits


def test_three_verdicts():
    assert stats.paired(np.r_[np.ones(150), np.zeros(50)], np.r_[np.ones(100), np.zeros(100)]).verdict == "differs"
    same = np.tile(np.r_[np.ones(500), np.zeros(500)], (3, 1))
    flip = same.copy()
    flip[:, :5] = 0
    flip[:, 500:505] = 1  # 10 of 1,000 examples disagree, no net difference
    assert stats.paired(same, flip, margin=0.02).verdict == "equivalent"
    a, b = np.r_[np.ones(20), np.zeros(20)], np.r_[np.ones(10), np.zeros(10), np.ones(10), np.zeros(10)]
    assert stats.paired(a, b, margin=0.02).verdict == "inconclusive"  # no net difference, half the examples disagree
    assert "equivalent within ±0.02" in stats.describe(stats.paired(same, flip, margin=0.02))


def test_power_is_statsmodels_one_sample_power_and_alpha_at_no_effect():
    from statsmodels.stats.power import TTestPower

    sd, n = 0.05, 30
    got = stats.power_difference(0.02, sd / math.sqrt(n), n - 1, 0.05)
    assert got == pytest.approx(TTestPower().power(effect_size=0.02 / sd, nobs=n, alpha=0.05), rel=1e-6)
    assert stats.power_difference(0.0, 0.01, 20, 0.05) == pytest.approx(0.05, rel=1e-9)
    assert stats.power_equivalence(0.02, 0.001, 100, 0.05) > 0.999 and stats.power_equivalence(0.02, 0.05, 5, 0.05) == 0


def test_power_at_few_seeds_and_a_large_effect_is_a_number_not_nan():
    """scipy's nct.cdf is NaN far in the lower tail (df 3, nc 9.8): the planner read that NaN as "not enough" and
    asked for a seed more than needed."""
    from statsmodels.stats.power import TTestPower

    got = stats.power_difference(0.02, 0.02 / 9.8, 3, 0.05 / 6)
    assert got == pytest.approx(TTestPower().power(effect_size=9.8 / 2, nobs=4, alpha=0.05 / 6), rel=1e-6)
    assert 0.9 < got < 1
    eq = stats.power_equivalence(0.02, 0.02 / 9.8, 3, 0.05 / 6)
    assert math.isfinite(eq) and 0.5 < eq < 1


def test_power_cli_on_records_without_per_example_scores(monkeypatch, capsys):
    """The command line as a process once (its exit status and one line), then its main in this process."""
    from qft.tools import power

    bad = subprocess.run([sys.executable, "-m", "qft.tools.power", "/no/such/folder"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "qft.tools.power: error: RECORDS='/no/such/folder': a folder of result records (result.json) or one record"]
    monkeypatch.chdir(ROOT)
    assert power.main(["results/rank_sweep/runs", "--delta", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "no per-example scores" in out and "| 200 |" in out
    for args, line in ((["results/rank_sweep/runs", "--simulate", "3"], "--simulate=3: records with per-example scores "
                        "(it simulates the paired test)"), (["results/rank_sweep/runs", "--simulate", "1"],
                                                            "--simulate=1: an integer >= 2 (seeds)")):
        assert power.main(args) == 2
        got = capsys.readouterr()
        assert got.err.strip().splitlines() == [f"qft.tools.power: error: {line}"] and not got.out


def test_power_pools_pairs_across_run_kinds_and_leaves_out_a_pair_across_two(tmp_path, capsys):
    """A study's pilot restarted on another CPU (finding 2's was): the planner reads it as the report does, a pair (two
    cells of one seed) on one run kind and pairs pooled across kinds; a pair whose two cells ran on different kinds is
    left out and named, never pooled as one comparison."""
    import shutil

    from qft.tools import power

    src = ROOT / "results/rank_sweep_r8_format2/runs"
    shutil.copytree(src, tmp_path / "runs")
    before = power.components(power.by_config(power.runs([src]), "accuracy"))
    amx = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_kind": "amx_bf16", "compute_dtype": "fp32"}
    seed0 = sorted((tmp_path / "runs").glob("*,seed=0"))
    for d in seed0:  # seed 0's cells all on another kind, and in fp32: one cell key with their bf16 seeds
        rec = json.loads((d / "result.json").read_text())
        rec["execution"] = {**rec["execution"], **amx}
        rec["config"]["quant"]["compute_dtype"] = "fp32"
        (d / "result.json").write_text(json.dumps(rec))
    configs = power.by_config(power.runs([tmp_path / "runs"]), "accuracy")
    assert len(configs) == 8 and power.refused(configs) == []  # eight trained cells, as before
    after = power.components(configs)
    assert after[1:] == before[1:] and after[0] == pytest.approx(before[0], rel=1e-12)  # the same pairs, pooled
    moved = next(d for d in seed0 if "adapter.attn.r=8,adapter.mlp.r=8," in d.name)
    rec = json.loads((moved / "result.json").read_text())
    rec["execution"]["cpu_kind"] = "avx2"  # one cell of seed 0 elsewhere: its 7 pairs with the other cells are out
    (moved / "result.json").write_text(json.dumps(rec))
    configs = power.by_config(power.runs([tmp_path / "runs"]), "accuracy")
    left = power.refused(configs)
    assert len(left) == 7 and all(x.startswith("seed 0: ") and f"{moved.name} on " in x for x in left)
    key = next(k for k, c in configs.items() if c[0][4] == moved)
    without = {k: ({s: v for s, v in c.items() if s != 0} if k == key else c) for k, c in configs.items()}
    assert power.components(configs)[0] == pytest.approx(power.components(without)[0], rel=1e-12)
    assert power.main([str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("records of 3 run kinds (") and "pairs (two cells of one seed) pool across kinds" in lines[1]
    assert lines[2].startswith("left out, their two cells on different run kinds: 7 pairs (seed 0: ")


def test_power_prices_scoring_from_runs_made_in_one_invocation():
    """A resumed run's training seconds sum its invocations and its wall seconds are the last one's (finding 2's two
    resumed pilot runs read -0.01 s an example): its scoring time is unknown, and the others' stands for it."""
    from qft.tools import power

    ex = {"cpu_kind": "amx_bf16"}
    sizes = {"data": {"sizes": {"val": 500, "test": 2000}}}
    one = {"execution": ex, "train_seconds": 1000.0, "wall_seconds": 1250.0, **sizes}
    resumed = {"execution": ex, "train_seconds": 1800.0, "wall_seconds": 1300.0, "execution_history": [ex, ex], **sizes}
    train_s, per_example, _ = power.hours_per_run([(None, one), (None, resumed)], "amx_bf16")
    assert train_s == 1400.0 and per_example == 0.1  # 250 s over 2,500 examples, from the whole run alone
    assert power.hours_per_run([(None, resumed)], "amx_bf16")[1] == 0.0  # only resumed runs: never below nothing


def test_power_cli_simulates_the_reports_own_test_at_the_chosen_seeds(monkeypatch, capsys):
    from qft.tools import power

    monkeypatch.chdir(ROOT)
    assert power.main(["results/rank_sweep_r8_format2/runs", "--simulate", "3", "--studies", "40", "--family", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("Simulated power of the report's own test (generalized interval) to find 0.02 at 0.0125, "
                           "3 seeds x 200 examples, 40 studies")
    comp, _, _ = power.components(power.by_config(power.runs(["results/rank_sweep_r8_format2/runs"]), "accuracy"))
    for scale in power.SEED_SCALES:  # the printed figures are the simulation's, with the seed component scaled
        c = {**comp, "seed": comp["seed"] * scale}
        assert f"seed component x{scale}: {power.simulated_power(c, 3, 200, 0.02, 0.0125, 40):.2f} (the t above: " \
               f"{stats.power_difference(0.02, stats.design_se(c, 3, 200), stats.design_df(c, 3, 200), 0.0125):.2f})" \
               in line


def test_macro_f1_and_per_class_accuracy_by_hand():
    from qft.tools import report

    gold = np.array([0, 0, 0, 1, 1, 2])
    pred = np.array([0, 0, 1, 1, 2, 2])
    got = report.class_scores({"gold": gold, "pred": pred}, ["a", "b", "c", "d"])  # d never occurs: left out
    # a: P 2/2 R 2/3 F1 0.8; b: P 1/2 R 1/2 F1 0.5; c: P 1/2 R 1/1 F1 2/3
    assert got["acc_class_a"] == pytest.approx(2 / 3) and got["acc_class_c"] == 1.0 and "acc_class_d" not in got
    assert got["macro_f1_test"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)


@pytest.mark.reproduce  # simulated studies: the test's size or coverage (make reproduce)
def test_paired_intervals_cover_with_a_thousand_examples_and_seed_noise(monkeypatch):
    """The committed design's shape with a large test split, where the seed term matters: 3 seeds, 1,000 examples."""
    monkeypatch.setattr(stats, "GPQ_DRAWS", 2000)
    rng = np.random.default_rng(11)
    hits = 0
    for _ in range(1000):
        q = rng.normal(-1.0, 1.0, 1000)
        b = rng.normal(0, 0.1, 1000)
        u = rng.normal(0, 0.04, (2, 3, 1))
        noise = rng.normal(0, 0.6, (2, 3, 1000))
        c = stats.paired(q + 0.01 + b / 2 + u[0] + noise[0], q - 0.01 - b / 2 + u[1] + noise[1])
        hits += c.low <= 0.02 <= c.high
    assert 0.93 <= hits / 1000 <= 0.97, hits


def test_a_real_difference_inside_the_margin_says_so():
    a = np.tile(np.r_[np.ones(5008), np.zeros(4992)], (3, 1))
    b = a.copy()
    b[:, :80] = 0  # 0.008 lower everywhere, on every seed: real, and far inside ±0.02
    c = stats.paired(a, b, margin=0.02)
    assert c.verdict == "differs" and c.within_margin and c.word() == "differs (by less than ±0.02)"


def test_a_difference_beyond_the_margin_says_so():
    """The minimum-effect test (finding 2's "more": one contrast beyond ±margin, another equivalent within it): the
    t-based p is the chance, at a true difference on the margin, of an estimate at least as far from 0 either side;
    the generalized one reads the same pivot."""
    c = stats._finish(0.05, 0.01, 50, 0.02, "x", 3)
    assert c.p_beyond == pytest.approx(st.t.sf(3.0, 50) + st.t.sf(7.0, 50)) and c.beyond_margin
    assert stats._finish(-0.05, 0.01, 50, 0.02, "x", 3).p_beyond == pytest.approx(c.p_beyond)  # the lower side
    assert c.word() == "differs (by more than ±0.02)" and c.negated().word() == "differs (by more than ±0.02)"
    near = stats._finish(0.03, 0.01, 50, 0.02, "x", 3)  # differs from 0, not shown to exceed 0.02
    assert near.verdict == "differs" and not near.beyond_margin and near.word() == "differs"
    assert near.p_beyond == pytest.approx(st.t.sf(1.0, 50) + st.t.sf(5.0, 50))
    assert stats._finish(0.0, 0.01, 50, 0.0, "x", 3).p_beyond == pytest.approx(1.0)  # margin 0: the two-sided p
    assert stats._finish(0.03, 0.01, 50, 0.0, "x", 3).p_beyond == pytest.approx(2 * st.t.sf(3.0, 50))
    assert stats._finish(-0.05, 0.0, 3, 0.02, "x", 3).beyond_margin  # exact, and beyond
    assert not stats._finish(0.01, 0.0, 3, 0.02, "x", 3).beyond_margin  # exact, and inside
    a = np.tile(np.r_[np.ones(5500), np.zeros(4500)], (3, 1))
    b = a.copy()
    b[:, :500] = 0  # 0.05 lower everywhere, on every seed
    for seed, k in enumerate((10, 12, 8)):  # a few the other way on every seed, so the pivots have a spread
        b[seed, 9000:9000 + k] = 1
    paired = stats.paired(a, b, margin=0.02)
    assert paired.beyond_margin and paired.word() == "differs (by more than ±0.02)"
    assert stats.paired(b, a, margin=0.02).p_beyond == pytest.approx(paired.p_beyond)  # the lower side
    inside = stats.paired(a, np.where(np.arange(10000) < 80, 0, a), margin=0.02)
    assert not inside.beyond_margin and inside.p_beyond == pytest.approx(1.0)  # 13 standard errors inside
    # correctness records: the split's pivot (`beyond_correct`); margin 0 gives its two-sided p
    assert paired.p_beyond == stats.beyond_correct(a - b, 0.02)
    assert stats.paired(a, b, margin=0.0).p_beyond <= paired.p_beyond < 0.01
    stats.holm([c, None, None])
    assert c.p_beyond_adj == pytest.approx(min(1.0, 3 * c.p_beyond))


@pytest.mark.reproduce  # simulated studies: the test's size or coverage (make reproduce)
def test_the_beyond_margin_test_holds_its_level_at_the_margin():
    """The t form against its own model: at a true difference of exactly ±margin it rejects alpha of the time (4,000
    studies: binomial SE 0.0034, the band +-3 SE), where each side's one-sided test doubled gave about alpha/2 and a
    wrong sign about 0; inside the margin (at 0 and at half of it) less. (The generalized form's level:
    test_the_equivalence_test_holds_its_level_at_the_margin.)"""
    rng = np.random.default_rng(11)
    se, df = 0.01, 30

    def rate(truth: float) -> float:
        return sum(stats._finish(truth + se * rng.standard_t(df), se, df, 0.02, "x", 3).beyond_margin
                   for _ in range(4000)) / 4000

    assert 0.040 <= rate(0.02) <= 0.060 and 0.040 <= rate(-0.02) <= 0.060
    assert rate(0.01) < 0.01 and rate(0.0) < 0.002


def test_holm_counts_a_missing_member_of_the_family():
    c = stats._finish(0.05, 0.01, 50, 0.02, "x", 3)
    stats.holm([c, None, None])
    assert c.p_adj == pytest.approx(min(1.0, 3 * c.p))


def test_a_non_finite_standard_error_makes_no_claim():
    c = stats._finish(0.01, float("nan"), 3, 0.02, "x", 3)
    assert c.verdict == "inconclusive" and (c.low, c.high) == (-math.inf, math.inf)
    assert stats._finish(0.01, 0.0, 3, 0.02, "x", 3).verdict == "differs"  # identical paired differences: exact


@pytest.mark.reproduce  # simulated studies: the test's size or coverage (make reproduce)
def test_a_true_null_is_rejected_at_most_at_its_level_at_the_holm_step(monkeypatch):
    """Verdicts are made at alpha/6, not at 95%: where the seed part of the paired difference is about 4x the rest, a
    Satterthwaite t (its df estimated from the same mean squares as its SE) rejected a true null at 0.020 here against
    0.0083; the generalized interval stays at its level (0.0083, within the simulation's error)."""
    monkeypatch.setattr(stats, "GPQ_DRAWS", 2000)
    rng = np.random.default_rng(5)
    s, n, reps = 3, 200, 3000
    rejected = 0
    for _ in range(reps):
        d = rng.normal(0, 0.04, (s, 1)) + rng.normal(0, 0.3, (s, n))  # N x seed variance = 4 x residual
        rejected += stats.paired(d, np.zeros((s, n))).p < 0.05 / 6
    assert rejected / reps <= 0.014, rejected


def test_the_planners_power_is_the_power_of_the_reports_verdict(monkeypatch):
    """The planner prices seeds with a noncentral t at Satterthwaite's df; the report decides with the generalized
    interval. At a design where the seed term dominates (4 seeds, df 3), the difference the planner says is found half
    the time is found by the report's test that often too (0.5 within the simulation's error; a normal in place of
    the t would claim 0.5 at 0.060, a difference the report finds a tenth of the time)."""
    from qft.tools import power

    monkeypatch.setattr(stats, "GPQ_DRAWS", 2000)
    s, n, alpha = 4, 200, 0.05 / 6
    comp = {"seed": 0.04 ** 2, "example": 0.0, "residual": 0.3 ** 2}
    se, df = stats.design_se(comp, s, n), stats.design_df(comp, s, n)
    delta = stats.smallest_difference(se, df, alpha, power=0.5)
    assert abs(power.simulated_power(comp, s, n, delta, alpha, 600) - 0.5) <= 0.06, delta


def test_a_paired_comparison_says_what_its_own_design_can_find():
    rng = np.random.default_rng(3)
    a, b = (rng.random((4, 500)) < 0.9).astype(float), (rng.random((4, 500)) < 0.9).astype(float)
    c = stats.paired(a, b)
    assert c.components == stats.crossed(a - b)[3]
    d = stats.detectable(c, 0.05 / 6)
    se, df = stats.design_se(c.components, 4, 500), stats.design_df(c.components, 4, 500)
    assert stats.power_difference(d, se, df, 0.05 / 6) >= 0.8 > stats.power_difference(d - 0.001, se, df, 0.05 / 6)
    assert stats.detectable(stats.welch([0.7, 0.72, 0.71], [0.69, 0.7, 0.68]), 0.05) is None  # no components


@pytest.mark.reproduce  # simulated studies: the test's size or coverage (make reproduce)
@pytest.mark.parametrize("seed_var,example_var,residual", [(7e-5, 0.0, 0.02), (2.4e-4, 1.5e-3, 0.028)],
                         ids=["finding1-contrast1", "finding3-int8"])
def test_the_equivalence_test_holds_its_level_at_the_margin(monkeypatch, seed_var, example_var, residual):
    """An "equivalent" verdict is a TOST rejection: where the true difference sits exactly on the margin (half the
    studies at +0.02, half at -0.02, so each one-sided test is tried), it must be reached 5% of the time at alpha 0.05,
    not more (a claim stronger than its data) and not much less (a test too weak to ever say equivalent). The designs
    are two "equivalent" verdicts' variance components as measured, 5 seeds each: finding 1's contrast 1 (seed 7e-05,
    residual 0.02) and finding 3's int8 contrast (seed 2.4e-04, example 1.5e-03, residual 0.028). 3,000 studies:
    binomial SE 0.004, so the band is +-3 SE; a TOST p halved or scaled by 0.7 gives 0.10 or 0.07 here, one from a
    single tail rejects every study on the other side, one at alpha/2 gives 0.025."""
    monkeypatch.setattr(stats, "GPQ_DRAWS", 2000)
    rng = np.random.default_rng(17)
    s, n, reps, margin = 5, 1000, 3000, 0.02
    said, beyond = 0, {margin: 0, -margin: 0}
    for i in range(reps):
        truth = margin if i % 2 else -margin
        d = (truth + rng.normal(0, seed_var ** 0.5, (s, 1)) + rng.normal(0, example_var ** 0.5, (1, n))
             + rng.normal(0, residual ** 0.5, (s, n)))
        c = stats.paired(d, np.zeros((s, n)), margin=margin)
        said += c.p_tost < 0.05
        beyond[truth] += c.p_beyond < 0.05
    assert 0.038 <= said / reps <= 0.062, said
    # the minimum-effect test on the same margin, from the other side: about alpha of the studies on each side (the
    # pivot's own rate at 5 seeds about 0.044, a review's 5,000 studies a side; 1,500 here: binomial SE 0.0056, the
    # band +-3 SE around 0.05 and below); doubling each side's one-sided test gave about alpha/2, one tail missing
    # gives 0 on a side
    assert all(0.030 <= k / (reps / 2) <= 0.067 for k in beyond.values()), beyond


def _splits(plus, minus, n=2160):
    """Correctness differences with, on seed s, plus[s] examples only A gets right and minus[s] only B."""
    d = np.zeros((len(plus), n))
    for s, (p, m) in enumerate(zip(plus, minus)):
        d[s, 7 * s:7 * s + p] = 1
        d[s, 1000 + 5 * s:1000 + 5 * s + m] = -1
    return d


def test_the_minimum_effect_test_on_correctness_records_reads_both_pivots():
    """Correctness records (-1/0/+1): the report's minimum-effect p is the larger of the mean's pivot's (the old one)
    and the split's pivot's, so it never falls below the old one and equals it where the split's is smaller; a
    seed whose discordant examples go the other way than the rest moves it far more than it moves the mean's pivot
    (five seeds that came out high, one low: the skew the size test measures)."""
    even = _splits((80, 78, 82, 79, 81), (22, 24, 20, 23, 21))  # seeds alike: the split's pivot is the smaller
    assert stats.beyond_correct(even, 0.02) == stats.beyond_mean(even, 0.02) == pytest.approx(0.0495, abs=5e-4)
    assert stats.paired(even, np.zeros_like(even), 0.02).p_beyond == stats.beyond_correct(even, 0.02)
    spread = _splits((75, 80, 85, 72, 88), (15, 12, 9, 16, 8))  # the split's log-odds spread across seeds
    assert stats.beyond_correct(spread, 0.02) > stats.beyond_mean(spread, 0.02)
    for d in (even, spread):
        got = [stats.beyond_correct(d, m) for m in (0.0, 0.01, 0.02, 0.03, 0.05)]
        assert got == sorted(got) and got[-1] == 1.0  # monotone in the margin; nothing beyond the discordance (~0.05)
        assert stats.beyond_correct(d, 0.02) == got[2]  # fixed draws: the same records, the same number
        assert stats.beyond_correct(-d, 0.02) == pytest.approx(got[2], abs=1e-12)  # either side
    # a difference smaller than the margin, all of it one way: nothing beyond
    assert stats.beyond_correct(_splits((20,) * 5, (0,) * 5), 0.02) == 1.0


def test_other_paired_records_keep_the_means_pivot():
    """Scores other than correctness (the gold label's log-likelihood) keep the generalized pivot's minimum-effect p."""
    rng = np.random.default_rng(3)
    a = rng.normal(0, 1, (5, 400))
    b = a - 0.3 + rng.normal(0, 0.5, (5, 400)) + rng.normal(0, 0.05, (5, 1))
    c = stats.paired(a, b, margin=0.2)
    assert c.p_beyond == stats.beyond_mean(a - b, 0.2) == stats.generalized(a - b, 0.2)[4]


@pytest.mark.parametrize("d, margin, message", [
    (np.ones((1, 10)), 0.02, "d of shape (1, 10); allowed: a (seeds >= 2, examples >= 1) matrix"),
    (np.ones(10), 0.02, "d of shape (10,); allowed"),
    (np.full((3, 10), 0.5), 0.02, "d has entries other than -1, 0 and +1; allowed: correctness differences"),
    (np.ones((3, 10)), -0.01, "margin=-0.01; allowed: a finite number >= 0"),
    (np.ones((3, 10)), float("nan"), "margin=nan; allowed: a finite number >= 0"),
])
def test_the_correctness_minimum_effect_test_refuses_bad_input(d, margin, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        stats.beyond_correct(d, margin)
