import itertools

import numpy as np
import pytest

from loongforge.core.balance import PlanError, imbalance, plan_step
from loongforge.core.balance.assign import plain_assignment
from loongforge.core.balance.ordering import ordered


def _check_plan(plan, tokens, num_ranks, token_cap=None, max_micro_batches=None):
    """The plan is a partition of the step's samples into non-empty micro-batches within the caps."""
    seen = []
    for r in range(num_ranks):
        micro_batches = plan.micro_batches(r)
        assert len(micro_batches) == plan.micro_counts[r] >= 1
        assert all(micro_batches), "empty micro-batch"
        if max_micro_batches is not None:
            assert len(micro_batches) <= max_micro_batches
        for mb in micro_batches:
            assert all(plan.rank[i] == r for i in mb)
            if token_cap is not None:
                assert tokens[mb].sum() <= token_cap
            seen += mb
    assert sorted(seen) == list(range(len(tokens)))


def _brute_force(costs, num_ranks):
    return min(np.bincount(a, weights=costs, minlength=num_ranks).max()
               for a in itertools.product(range(num_ranks), repeat=len(costs)))


def test_matches_brute_force_on_tiny_instances():
    rng = np.random.default_rng(3)
    ratios = []
    for _ in range(150):
        ranks = int(rng.integers(2, 4))
        costs = rng.integers(1, 100, int(rng.integers(ranks, 8))).astype(float)
        plan = plan_step(costs, costs, ranks, skip_threshold=1.0, tolerance=0.0)
        _check_plan(plan, costs, ranks)
        ratios.append(plan.rank_costs.max() / _brute_force(costs, ranks))
        assert ratios[-1] <= 4 / 3 - 1 / (3 * ranks) + 1e-12  # never worse than Graham's LPT bound
    ratios = np.array(ratios)
    assert ratios.min() >= 1.0 - 1e-12
    assert np.mean(ratios <= 1 + 1e-12) >= 0.9  # optimal on nine in ten instances or more


def test_refinement_fixes_the_classic_lpt_failure():
    # LPT alone: {3, 2, 2} and {3, 2} -> 7; the optimum {3, 3} / {2, 2, 2} is 6
    plan = plan_step(np.array([3.0, 3, 2, 2, 2]), np.ones(5), 2, skip_threshold=1.0, tolerance=0.0)
    assert plan.rank_costs.max() == 6.0


def test_matches_brute_force_with_token_caps():
    rng = np.random.default_rng(5)
    ranks, micro = 2, 2
    optimal = 0
    for trial in range(60):
        tokens = rng.integers(1, 10, int(rng.integers(2, 7))).astype(float)
        costs = tokens**2 + 3 * tokens
        cap = int(max(tokens.max(), np.ceil(tokens.sum() / (ranks * micro) * 1.3)))
        best = min(np.bincount(np.array(a) // micro, weights=costs, minlength=ranks).max()
                   for a in itertools.product(range(ranks * micro), repeat=len(tokens))
                   if np.bincount(a, weights=tokens, minlength=ranks * micro).max() <= cap)
        plan = plan_step(costs, tokens, ranks, token_cap=cap, max_micro_batches=micro, skip_threshold=1.0,
                         tolerance=0.0)
        _check_plan(plan, tokens, ranks, cap, micro)
        assert plan.rank_costs.max() >= best - 1e-9
        optimal += plan.rank_costs.max() <= best + 1e-9
    assert optimal >= 54


@pytest.mark.parametrize("token_cap", [None, 6000])
@pytest.mark.parametrize("max_micro_batches", [None, 3])
def test_plan_is_a_partition_within_the_caps(token_cap, max_micro_batches):
    rng = np.random.default_rng(7)
    for _ in range(20):
        ranks = int(rng.integers(1, 24))
        tokens = rng.integers(1, 3000, int(rng.integers(ranks, ranks * 10))).astype(float)
        costs = 1e-3 * tokens**2 + tokens + 5.0
        plan = plan_step(costs, tokens, ranks, token_cap=token_cap, max_micro_batches=max_micro_batches,
                         skip_threshold=1.0)
        _check_plan(plan, tokens, ranks, token_cap, max_micro_batches)
        np.testing.assert_allclose(plan.rank_costs, np.bincount(plan.rank, weights=costs, minlength=ranks))
        assert plan.metrics.imbalance_after <= plan.metrics.imbalance_before + 1e-12
        assert plan.metrics.imbalance_after == pytest.approx(imbalance(plan.rank_costs))


def test_skewed_step_is_strictly_improved():
    rng = np.random.default_rng(11)
    tokens = np.sort(rng.integers(256, 100_000, 64 * 16)).astype(float)  # sorted: the plain split piles up
    costs = 1e-4 * tokens**2 + 10 * tokens
    plan = plan_step(costs, tokens, 64, token_cap=131_072)
    _check_plan(plan, tokens, 64, 131_072)
    before = imbalance(np.bincount(plain_assignment(len(tokens), 64), weights=costs))
    assert plan.metrics.imbalance_before == pytest.approx(before)
    assert before > 1.5
    assert plan.metrics.rebalanced and plan.metrics.imbalance_after < 1.01


def test_skip_threshold_keeps_the_plain_split():
    rng = np.random.default_rng(2)
    tokens = rng.integers(1000, 1010, 8 * 32).astype(float)  # nearly uniform
    costs = tokens.copy()
    plan = plan_step(costs, tokens, 8, skip_threshold=1.02)
    assert not plan.metrics.rebalanced
    np.testing.assert_array_equal(plan.rank, plain_assignment(len(tokens), 8))
    assert plan.metrics.imbalance_after == plan.metrics.imbalance_before < 1.02
    forced = plan_step(costs, tokens, 8, skip_threshold=1.0, tolerance=0.0)
    assert forced.metrics.rebalanced
    assert forced.metrics.imbalance_after < plan.metrics.imbalance_before


def test_plain_split_is_kept_when_the_solver_cannot_beat_it():
    costs = np.full(12, 5.0)  # perfectly balanced already
    plan = plan_step(costs, costs, 4, skip_threshold=1.0)
    assert not plan.metrics.rebalanced
    np.testing.assert_array_equal(plan.rank, plain_assignment(12, 4))


def test_sample_longer_than_the_cap_is_a_clear_error():
    tokens = np.array([100.0, 9000.0, 200.0, 300.0])
    with pytest.raises(PlanError, match=r"sample 1 of the step has 9000 tokens, more than token_cap=8192"):
        plan_step(tokens, tokens, 2, token_cap=8192)
    with pytest.raises(PlanError, match="more than num_ranks\\*max_micro_batches\\*token_cap = 2\\*1\\*300"):
        plan_step(np.array([100.0, 250, 300]), np.array([100.0, 250, 300]), 2, token_cap=300, max_micro_batches=1)
    with pytest.raises(PlanError, match="3 samples cannot give each of 4 ranks"):
        plan_step(tokens[:3], tokens[:3], 4)


def test_plan_is_deterministic():
    rng = np.random.default_rng(13)
    tokens = rng.integers(32, 16384, 4096).astype(float)
    tokens[::7] = 512.0  # many ties
    costs = 1e-4 * tokens**2 + tokens
    first = plan_step(costs, tokens, 64, token_cap=16384)
    again = plan_step(costs.copy(), tokens.copy(), 64, token_cap=16384)
    assert first.same_assignment(again)
    assert first.metrics == again.metrics
    assert first.metrics.imbalance_after < 1.005


def test_orderings_break_ties_by_position():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 5, 500).astype(float)
    groups = rng.integers(0, 7, 500)
    np.testing.assert_array_equal(ordered(values), np.lexsort((np.arange(500), -values)))
    np.testing.assert_array_equal(ordered(values, descending=False), np.lexsort((np.arange(500), values)))
    np.testing.assert_array_equal(ordered(values, groups=groups), np.lexsort((np.arange(500), -values, groups)))
    np.testing.assert_array_equal(ordered(groups=groups), np.lexsort((np.arange(500), groups)))


def test_fixed_micro_batches_without_cap_even_the_cost():
    rng = np.random.default_rng(4)
    costs = rng.uniform(1, 10, 8 * 40)
    plan = plan_step(costs, np.ones_like(costs), 8, max_micro_batches=4, skip_threshold=1.0)
    _check_plan(plan, np.ones_like(costs), 8, None, 4)
    for r in range(8):
        per_micro = [costs[mb].sum() for mb in plan.micro_batches(r)]
        assert len(per_micro) == 4 and max(per_micro) - min(per_micro) <= costs.max()
