"""The minimum-effect test's size on the records' own shape (`make reproduce`, not `make test`: about 10,000 simulated
studies). Shape: finding 1's and finding 3's committed 5-seed pairs near the margin (`qft.tools.studysim`, the sampler
experiments/finding2/size_check.py uses); truth exactly on the margin (+0.02), a normal seed law on which way a seed's
discordant documents go, at seed components 0 to 3e-4 (finding 3's int8 pair has 2.4e-4). The report's test
(`stats.beyond_correct`) must reject at most 0.06 of 2,000 studies a row at 0.05 and 0.015 at 0.01 (binomial SE
0.005 and 0.0022 at the nominal rates); the mean's pivot it replaced (`stats.beyond_mean`) fails that bound on the
same studies at the largest component."""

from pathlib import Path

import numpy as np
import pytest

from qft import stats
from qft.tools import studysim

pytestmark = pytest.mark.reproduce

ROOT = Path(__file__).resolve().parents[1]
REPS, BATCH = 2000, 250
COMPONENTS = (0.0, 7.5e-5, 1.5e-4, 2.4e-4, 3e-4)


@pytest.fixture(scope="module")
def shape():
    fitted, pi, near, _ = studysim.near_shape([str(ROOT / s) for s in studysim.SOURCES])
    assert len(near) == 10  # the pairs size_check.txt names
    return fitted, pi


@pytest.mark.parametrize("component", COMPONENTS)
def test_the_minimum_effect_test_holds_its_level_on_sparse_records_with_a_seed_component(shape, component):
    fitted, pi = shape
    theta, sd_a, sd_b = studysim.calibrate(studysim.MARGIN, component, None, "normal", pi)
    rng = np.random.default_rng(20261207 + COMPONENTS.index(component))
    new, old = [], []
    for _ in range(REPS // BATCH):
        for d in studysim.study(rng, fitted, "normal", theta, sd_a, sd_b, reps=BATCH):
            old.append(stats.beyond_mean(d, studysim.MARGIN))
            new.append(max(old[-1], stats._beyond_split(d, studysim.MARGIN)))  # beyond_correct, the old pivot once
    assert new[-1] == stats.beyond_correct(d, studysim.MARGIN)
    new, old = np.array(new), np.array(old)
    sizes = {name: ((p < 0.05).mean(), (p < 0.01).mean()) for name, p in (("new", new), ("old", old))}
    print(f"seed component {component:.2g}: size at 0.05 / 0.01, the report's test {sizes['new'][0]:.4f} / "
          f"{sizes['new'][1]:.4f}, the mean's pivot {sizes['old'][0]:.4f} / {sizes['old'][1]:.4f}")
    assert sizes["new"][0] <= 0.06 and sizes["new"][1] <= 0.015, sizes
    if component == max(COMPONENTS):  # the procedure it replaced fails the same bound on the same studies
        assert sizes["old"][0] > 0.06 and sizes["old"][1] > 0.015, sizes
