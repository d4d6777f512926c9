"""Two gloo processes: pooled cost fit broadcast from rank 0, and a balanced epoch over DP=2."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from loongforge.core.balance import (BalancedBatchSampler, CostFitter, CostModel, SampleSizes,
                                         broadcast_cost_model, fit_and_broadcast, step_batches)

    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    TRUE = dict(a=2e-9, b=3e-5, c=1e-3, overhead=0.05)

    def measurements(r):
        """Rank r's warm-up: 12 steps of its samples and the seconds the true model gives (1% noise)."""
        rng = np.random.default_rng(100 + r)
        fitter = CostFitter()
        for _ in range(12):
            sizes = SampleSizes.from_lengths([int(x) for x in rng.integers(64, 8192, int(rng.integers(1, 6)))])
            seconds = (TRUE["a"] * sizes.squares.sum() + TRUE["b"] * sizes.tokens.sum()
                       + TRUE["c"] * len(sizes) + TRUE["overhead"])
            fitter.add_sizes(sizes, seconds * (1 + 0.01 * rng.standard_normal()))
        return fitter

    result = {}
    fit = fit_and_broadcast(measurements(rank))
    result["fit"] = [*fit.model.as_tuple(), fit.overhead, fit.num_measurements]
    if rank == 0:  # the same fit from all ranks' data in one process
        pooled = CostFitter()
        pooled.load_statistics(sum(measurements(r).statistics() for r in range(world)))
        local = pooled.fit()
        result["local_fit"] = [*local.model.as_tuple(), local.overhead, local.num_measurements]

    sent = broadcast_cost_model(CostModel(a=1.5, b=2.5, c=3.5) if rank == 0 else None)
    result["broadcast"] = list(sent.as_tuple())

    try:
        fit_and_broadcast(CostFitter())  # nothing measured: every rank gets rank 0's error
    except ValueError as err:
        result["error"] = str(err)

    class Tokens(Dataset):
        def __init__(self, lengths):
            self.lengths = lengths
        def __len__(self):
            return len(self.lengths)
        def __getitem__(self, i):
            return torch.full((self.lengths[i],), i, dtype=torch.int64)

    def pack(samples):
        lens = torch.tensor([len(s) for s in samples])
        return torch.cat(samples), torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])

    rng = np.random.default_rng(7)
    lengths = [int(x) for x in np.clip(rng.lognormal(np.log(600), 1.2, 90), 16, 8192)]
    sampler = BalancedBatchSampler(lengths, samples_per_step=16, dp_rank=rank, dp_size=world,
                                   cost_model=fit.model, token_cap=8192, seed=3)
    loader = DataLoader(Tokens(lengths), batch_sampler=sampler, collate_fn=pack)
    grouped = step_batches(loader)
    consumed, token_sums, totals = [], [], []
    for _ in range(sampler.steps_per_epoch):
        batches, planned = next(grouped)
        mine = [int(ids[start]) for ids, cu in batches for start in cu[:-1].tolist()]
        assert mine == planned.indices
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        consumed.append(sorted(i for part in everyone for i in part))
        tokens = torch.tensor([float(sum(ids.numel() for ids, _ in batches))])  # what this rank computed
        dist.all_reduce(tokens)
        token_sums.append(tokens.item())
        totals.append(float(sum(lengths[i] for i in consumed[-1])))
    result.update(consumed=consumed, token_sums=token_sums, totals=totals,
                  steps_per_epoch=sampler.steps_per_epoch, lengths=lengths,
                  state=sampler.state_dict())
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_two_gloo_ranks_fit_broadcast_and_balanced_epoch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "store"), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))

    # the pooled fit: the same numbers on both ranks, equal to fitting all data in one place
    assert r0["fit"] == r1["fit"]
    assert r0["fit"] == pytest.approx(r0["local_fit"], rel=1e-9)
    a, b, c, overhead, count = r0["fit"]
    assert count == 24
    assert a == pytest.approx(2e-9, rel=0.15) and b == pytest.approx(3e-5, rel=0.1)
    assert r0["broadcast"] == r1["broadcast"] == [1.5, 2.5, 3.5]
    assert r0["error"] == r1["error"]
    assert r0["error"].startswith("cost fit on rank 0 failed: cost fit needs at least 4 measurements, has 0")

    # the balanced epoch: each step's samples read once over both ranks; the epoch covers the dataset once
    assert r0["consumed"] == r1["consumed"]
    flat = [i for step in r0["consumed"] for i in step]
    assert all(len(step) == 16 for step in r0["consumed"])
    assert len(flat) == len(set(flat)) == 16 * r0["steps_per_epoch"] == 80
    assert set(flat) == set(np.random.default_rng([3, 0]).permutation(90)[:80].tolist())  # all but the tail
    assert r0["token_sums"] == r0["totals"]  # the tokens both ranks computed are the step's tokens
    assert r0["state"]["consumed_samples"] == r1["state"]["consumed_samples"] == 80
