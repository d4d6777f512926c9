"""BalancedSteps: the balancer as the trainer's step iterator (plans, state, resume, online fit)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loongforge.core.balance import CostModel
from loongforge.core.training.balanced import BalancedSteps, cost_model_from_config
from loongforge.core.training.schema import BalanceConfig


class Samples:
    """Sample i is ``lengths[i]`` copies of i, so a collated micro-batch says which samples it holds."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((self.lengths[i],), i, dtype=torch.int64)


def collate(samples):
    return {"ids": torch.cat(samples)}


def lengths(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(200), 1.0, n), 8, 1024)]


def steps(lens, rank=0, dp=2, config=None, **kw):
    kw.setdefault("samples_per_step", 8)
    return BalancedSteps(Samples(lens), lens, collate, config or BalanceConfig(), token_cap=1024, dp_rank=rank,
                         dp_size=dp, seed=3, flops_per_token=lambda s: 1000.0 + 2.0 * s, **kw)


def contents(step):
    return [sorted(set(mb["ids"].tolist())) for mb in step.micro_batches]


def test_steps_partition_the_global_batch_and_carry_metrics():
    lens = lengths()
    ranks = [steps(lens, r) for r in range(2)]
    for _ in range(9):  # crosses the epoch boundary (7 steps of 8 out of 60)
        got = [next(s) for s in ranks]
        ids = [sorted(i for mb in contents(g) for i in mb) for g in got]
        assert sorted(got[0].sample_ids) == ids[0] and sorted(got[1].sample_ids) == ids[1]
        assert not set(ids[0]) & set(ids[1]) and len(ids[0]) + len(ids[1]) == 8
        for g, mine in zip(got, ids):
            assert g.tokens == sum(lens[i] for i in mine)
            assert all(mb["ids"].numel() <= 1024 for mb in g.micro_batches)
        same = [{k: v for k, v in g.metrics.items() if k != "balance/solver_ms"} for g in got]  # wall time differs
        assert same[0] == same[1] and "balance/imbalance_before" in same[0]
        assert got[0].metrics["balance/imbalance_after"] <= got[0].metrics["balance/imbalance_before"]


def test_disabled_keeps_the_plain_split():
    lens = lengths()
    on, off = steps(lens), steps(lens, config=BalanceConfig(enable=False))
    before = []
    for _ in range(7):
        a, b = next(on), next(off)
        assert b.metrics["balance/rebalanced"] == 0.0
        assert b.metrics["balance/imbalance_after"] == b.metrics["balance/imbalance_before"]
        before.append(a.metrics["balance/imbalance_before"])
        assert a.metrics["balance/imbalance_after"] <= b.metrics["balance/imbalance_after"]
    assert max(before) > 1.1  # the mix is unbalanced to begin with


@pytest.mark.parametrize("taken", [0, 3, 7, 8])
def test_resume_from_state_replays_the_same_steps(taken):
    lens = lengths()
    reference = steps(lens, rank=1)
    expected = [contents(next(reference)) for _ in range(12)]
    run = steps(lens, rank=1)
    for _ in range(taken):
        next(run)
    state = run.state_dict()
    assert state["sampler"]["consumed_samples"] == taken * 8
    resumed = steps(lens, rank=1, consumed_samples=taken * 8)
    resumed.load_state_dict(state)
    assert [contents(next(resumed)) for _ in range(12 - taken)] == expected[taken:]


def test_state_keeps_the_coefficients_in_use():
    lens = lengths()
    run = steps(lens)
    next(run)
    run.set_cost_model(CostModel(a=1.0, b=0.0, c=0.0))
    state = run.state_dict()
    fresh = steps(lens, consumed_samples=8)
    fresh.load_state_dict(state)
    assert fresh.cost_model == CostModel(a=1.0, b=0.0, c=0.0)
    assert [contents(next(fresh)) for _ in range(3)] == [contents(next(run)) for _ in range(3)]
    with pytest.raises(ValueError, match="sampler state seed=3 does not match"):
        BalancedSteps(Samples(lens), lens, collate, BalanceConfig(coefficients=[0.0, 1.0, 0.0]), samples_per_step=8,
                      token_cap=1024, dp_rank=0, dp_size=2, seed=4).load_state_dict(state)


def test_cost_model_from_config():
    assert cost_model_from_config(BalanceConfig(coefficients=[1.0, 2.0, 3.0]), None) == CostModel(1.0, 2.0, 3.0)
    flops = cost_model_from_config(BalanceConfig(), lambda s: 600.0 + 6.0 * s)  # per token: b + a*L
    assert (flops.a, flops.b, flops.c) == pytest.approx((6.0, 600.0, 0.0))
    with pytest.raises(ValueError, match="balance.coefficients is not set"):
        cost_model_from_config(BalanceConfig(), None)
    with pytest.raises(ValueError, match=r"balance.coefficients=\[1.0, 2.0\]: three numbers"):
        BalanceConfig(coefficients=[1.0, 2.0])


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_online_fit_recovers_the_step_time_model(world_of_one):
    """Compute seconds from a known a*sum(l^2) + b*tokens + c*samples: after ``fit_steps``
    measured steps (the first is warm-up) the planner uses the fitted coefficients."""
    true = CostModel(a=3e-7, b=2e-4, c=5e-3)
    lens = lengths(200, seed=1)
    run = steps(lens, dp=1, config=BalanceConfig(fit_steps=6), samples_per_step=5)
    for k in range(7):
        step = next(run)
        assert run.measuring
        ids = step.sample_ids
        seconds = sum(true.cost(lens[i]) for i in ids)
        run.record_compute_seconds(seconds)
        if k < 6:
            assert run.cost_model.as_tuple() == pytest.approx((2.0, 1000.0, 0.0))  # the FLOPs formula
    assert not run.measuring
    assert run.cost_model.as_tuple() == pytest.approx(true.as_tuple(), rel=1e-6)
    after = next(run)
    assert after.metrics["balance/fit_ok"] == 1.0 and after.metrics["balance/fit_a"] == pytest.approx(true.a, rel=1e-6)
    state = run.state_dict()
    assert state["fit"]["done"] and state["cost_model"] == pytest.approx(list(true.as_tuple()), rel=1e-6)
    resumed = steps(lens, dp=1, config=BalanceConfig(fit_steps=6), samples_per_step=5, consumed_samples=40)
    resumed.load_state_dict(state)
    assert not resumed.measuring and resumed.cost_model == run.cost_model


def test_failed_fit_keeps_the_formula(world_of_one):
    lens = lengths()
    run = steps(lens, dp=1, config=BalanceConfig(fit_steps=2), samples_per_step=4)  # 2 measurements: too few
    formula = run.cost_model
    for _ in range(3):
        next(run)
        run.record_compute_seconds(0.1)
    assert not run.measuring and run.cost_model == formula
    assert next(run).metrics["balance/fit_ok"] == 0.0
