import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from loongforge.core.balance import BalancedBatchSampler, CostModel, step_batches

COST = CostModel(a=1e-4, b=1.0, c=10.0)


def _lengths(n=203, seed=0):
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(400), 1.0, n), 8, 4096)]


def _sampler(lengths, rank, dp=4, **kw):
    kw.setdefault("samples_per_step", 24)
    kw.setdefault("token_cap", 4096)
    return BalancedBatchSampler(lengths, dp_rank=rank, dp_size=dp, cost_model=COST, seed=5, **kw)


def test_ranks_partition_every_step_and_cover_the_epoch_once():
    lengths = _lengths()
    samplers = [_sampler(lengths, r) for r in range(4)]
    steps = [list(s.steps()) for s in samplers]
    assert all(len(st) == 203 // 24 for st in steps)
    perm = np.random.default_rng([5, 0]).permutation(203)
    used = []
    for k in range(203 // 24):
        step = sorted(i for st in steps for i in st[k].indices)
        assert step == sorted(perm[k * 24:(k + 1) * 24].tolist())  # the step's samples, each once
        assert len({st[k].metrics for st in steps}) == 1  # every rank computed the same plan
        for st in steps:
            for mb in st[k].micro_batches:
                assert sum(lengths[i] for i in mb) <= 4096
        used += step
    assert len(used) == len(set(used)) == 8 * 24
    assert set(range(203)) - set(used) == set(perm[8 * 24:].tolist())  # only the tail is dropped
    # balanced: max/mean rank cost stays close to 1 although lengths vary 500x
    assert max(st[k].metrics.imbalance_after for st in steps for k in range(8)) < 1.1


def test_same_rank_same_stream_and_epochs_differ():
    lengths = _lengths()
    a, b = _sampler(lengths, 2), _sampler(lengths, 2)
    first, again = list(a), list(b)
    assert first == again
    second_epoch = list(a)  # the position moved on to epoch 1
    assert a.consumed_samples == 2 * 8 * 24
    assert sorted(sum(first, [])) != sorted(sum(second_epoch, []))


def _micro_stream(sampler, epochs):
    for _ in range(epochs):
        yield from sampler


@pytest.mark.parametrize("where", ["start", "mid-step", "step-end", "second-epoch"])
def test_resume_mid_epoch_gives_the_same_stream(where):
    lengths = _lengths()
    reference = list(_micro_stream(_sampler(lengths, 1), 2))
    counts = [len(_sampler(lengths, 1).plan_for_step(k).micro_batches) for k in range(16)]
    boundaries = np.cumsum(counts).tolist()  # micro-batches handed out after each full step
    taken = {"start": 0, "mid-step": boundaries[2] + 1, "step-end": boundaries[4],
             "second-epoch": boundaries[9] + 1}[where]
    assert counts[3] > 1  # so "mid-step" is inside a step

    run = _sampler(lengths, 1)
    stream = _micro_stream(run, 2)
    got = [next(stream) for _ in range(taken)]
    state = run.state_dict()
    done = state["consumed_samples"] // 24
    assert done == sum(b <= taken for b in boundaries)  # only full steps count

    resumed = _sampler(lengths, 1)
    resumed.load_state_dict(state)
    rest = list(_micro_stream(resumed, 2 - done // 8))
    replayed = boundaries[done - 1] if done else 0
    assert got[replayed:] == rest[:taken - replayed]  # a partial step is replayed identically
    assert got[:replayed] + rest == reference


def test_state_dict_checks_and_errors():
    lengths = _lengths()
    sampler = _sampler(lengths, 0)
    state = sampler.state_dict(consumed_samples=48)
    assert state == {"consumed_samples": 48, "samples_per_step": 24, "seed": 5, "shuffle": True, "num_samples": 203}
    other = BalancedBatchSampler(lengths, samples_per_step=24, dp_rank=0, dp_size=4, cost_model=COST, seed=6)
    with pytest.raises(ValueError, match="seed=5 does not match this sampler's seed=6"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="consumed_samples=50 is not a non-negative multiple of samples_per_step=24"):
        sampler.load_state_dict({"consumed_samples": 50})
    with pytest.raises(ValueError, match="dataset sample 3 has 5000 tokens, more than token_cap=4096"):
        _sampler([10, 20, 30, 5000] + [10] * 40, 0)
    with pytest.raises(ValueError, match="samples_per_step=2 must be >= dp_size=4"):
        _sampler(lengths, 0, samples_per_step=2)


class _Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((self.lengths[i],), i, dtype=torch.int64)


def _pack(samples):
    """One packed sequence and the sample boundaries (cu_seqlens)."""
    lens = torch.tensor([len(s) for s in samples])
    return {"ids": torch.cat(samples), "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_batch_sampler_and_step_grouping(workers):
    lengths = _lengths(150)
    sampler = _sampler(lengths, 3, samples_per_step=20)
    loader = DataLoader(_Tokens(lengths), batch_sampler=sampler, collate_fn=_pack, num_workers=workers)
    reference = _sampler(lengths, 3, samples_per_step=20)
    grouped = step_batches(loader)
    for step in range(10):  # crosses the epoch boundary (7 steps per epoch)
        batches, planned = next(grouped)
        want = reference.plan_for_step(step)
        assert planned.step == step and planned.micro_batches == want.micro_batches
        assert len(batches) == len(want.micro_batches)
        for batch, mb in zip(batches, want.micro_batches):
            assert batch["ids"].numel() <= 4096
            starts = batch["cu_seqlens"][:-1]
            assert batch["ids"][starts].tolist() == mb  # the loader read exactly the planned samples
        # without workers the sampler's position is the trainer's; with workers it reads ahead,
        # so the trainer passes its own count
        trained = (step + 1) * 20
        if workers == 0:
            assert sampler.consumed_samples == trained
        else:
            assert sampler.consumed_samples >= trained
        assert sampler.state_dict(consumed_samples=trained)["consumed_samples"] == trained


def test_cost_model_change_replans_and_segments_count():
    packed = [[int(x) for x in np.random.default_rng(i).integers(16, 512, 1 + i % 4)] for i in range(96)]
    sampler = BalancedBatchSampler(packed, samples_per_step=32, dp_rank=0, dp_size=4, cost_model=COST,
                                   token_cap=2048, skip_threshold=1.0)
    before = sampler.plan_for_step(0)
    assert sampler.sizes.squares[5] == sum(x * x for x in packed[5])
    sampler.set_cost_model(CostModel(a=1.0, b=0.0, c=0.0))  # attention only: very different costs
    after = sampler.plan_for_step(0)
    assert sorted(before.indices) != sorted(after.indices) or before.micro_batches != after.micro_batches
    assert after.metrics.imbalance_after <= after.metrics.imbalance_before
