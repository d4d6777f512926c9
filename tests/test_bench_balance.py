"""The partitioning baselines of the DP-balance bench (``bench/balance_baselines.py``,
``bench/cpu_step_times.py``: benchmark code, not loongforge-core's): every sample gets one rank, and
on small cases they find the textbook answers."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the bench's modules, as its scripts import them

from balance_baselines import karmarkar_karp_assignment, lpt_assignment  # noqa: E402


@pytest.mark.parametrize("assign", [lpt_assignment, karmarkar_karp_assignment])
def test_every_sample_on_one_rank_and_loads_close_to_the_mean(assign):
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 1, 400)
    rank_of = assign(costs, 8)
    assert rank_of.shape == (400,) and set(np.unique(rank_of)) <= set(range(8))
    loads = np.bincount(rank_of, weights=costs, minlength=8)
    assert loads.sum() == pytest.approx(costs.sum())
    assert loads.max() / loads.mean() < 1.01  # many small items: both get close to perfect


def test_lpt_and_kk_on_the_classic_two_way_case():
    costs = np.array([8, 7, 6, 5, 4], dtype=float)  # perfect split: {8, 7} vs {6, 5, 4} = 15 / 15
    lpt = np.bincount(lpt_assignment(costs, 2), weights=costs)
    kk = np.bincount(karmarkar_karp_assignment(costs, 2), weights=costs)
    assert sorted(lpt) == [13, 17]  # LPT: 8+5+4 vs 7+6
    assert sorted(kk) == [14, 16]  # differencing: 8-7=1, 6-5=1, 4-1=3, 3-1=2
    assert np.bincount(lpt_assignment(np.array([5.0, 1.0, 1.0]), 3), minlength=3).tolist() == [1, 1, 1]


@pytest.mark.slow
def test_measured_step_times_of_each_policy_from_a_two_process_gloo_run():
    from cpu_step_times import POLICIES, CpuWorkload, measure_step_times

    lengths = np.array([40, 8, 8, 8, 300, 16, 16, 8] * 2)
    times = measure_step_times(lengths, samples_per_step=8, steps=2, world=2, workload=CpuWorkload(width=16, gemms=2))
    assert set(times) == set(POLICIES) and all(len(v) == 2 and min(v) > 0 for v in times.values())
    with pytest.raises(ValueError, match="16 lengths for 3 steps"):
        measure_step_times(lengths, samples_per_step=8, steps=3)
