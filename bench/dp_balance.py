"""DP load balancing: simulated step time of plain sequential assignment vs the balancer.

Baseline: the plain split a distributed sampler makes (each DP rank takes the next contiguous
samples_per_step / DP samples of the shuffled step). Balancer: ``loongforge.core.balance.plan_step``
on the same samples. Both are scored with one cost model, the FLOP formula of a Llama-3-8B-shaped
model (``transformer_cost_model``), turned into seconds at an assumed 400 TFLOP/s per GPU; a
compute-bound step lasts as long as its most loaded rank, so

    imbalance = max / mean rank cost, scaling efficiency = mean / max = 1 / imbalance.

Length mixes (samples per rank per step, micro-batch token cap):
  text-sft    chat SFT, lognormal lengths (median 700, sigma 1.0), 32..16K tokens
  image-text  text (median 200) + 1-8 images of 256-1,280 tokens each, one sequence
  video       8K-100K tokens (log-uniform) + a short prompt
  mixed       70% text-sft, 25% image-text, 5% video in one step

"solver ms" is the wall time of one plan_step call (median and max over the rows' steps), "cpu"
the median CPU time of the calling thread (the same work, without time the OS gave to other
processes). "mb/rank" is the mean number of micro-batches per rank.

"bound" is the best max/mean any assignment can reach without splitting a sample:
max(largest sample, mean rank cost) / mean rank cost.

Usage: uv run python bench/dp_balance.py [--trials 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm.auto import tqdm

from loongforge.core.balance import SampleSizes, plan_step, transformer_cost_model
from loongforge.core.balance.assign import plain_assignment

FLOPS_PER_SECOND = 400e12  # achieved bf16 throughput per GPU assumed for the simulated seconds
COST = transformer_cost_model(hidden_size=4096, num_layers=32, ffn_hidden_size=14336, num_attention_heads=32,
                              num_query_groups=8, vocab_size=128256)
DP_SIZES = (8, 64, 512)


def text_sft(rng, n):
    return np.clip(rng.lognormal(np.log(700), 1.0, n), 32, 16384).astype(np.int64)


def image_text(rng, n):
    text = np.clip(rng.lognormal(np.log(200), 0.8, n), 16, 4096)
    images = rng.integers(1, 9, n)
    image_tokens = np.array([rng.integers(256, 1281, k).sum() for k in images])
    return (text + image_tokens).astype(np.int64)


def video(rng, n):
    frames = np.exp(rng.uniform(np.log(8192), np.log(100_000), n))
    return (frames + rng.integers(64, 512, n)).astype(np.int64)


def mixed(rng, n):
    kind = rng.choice(3, size=n, p=[0.70, 0.25, 0.05])
    out = text_sft(rng, n)
    out[kind == 1] = image_text(rng, int((kind == 1).sum()))
    out[kind == 2] = video(rng, int((kind == 2).sum()))
    return out


MIXES = {  # name: (lengths, samples per rank per step, token cap per micro-batch)
    "text-sft": (text_sft, 64, 16_384),
    "image-text": (image_text, 16, 16_384),
    "video": (video, 4, 131_072),
    "mixed": (mixed, 64, 131_072),
}


def run(trials: int, seed: int) -> list[dict]:
    rows = []
    configs = [(mix, dp) for mix in MIXES for dp in DP_SIZES]
    for mix, dp in tqdm(configs, desc="dp_balance", leave=False):
        make, per_rank, cap = MIXES[mix]
        rng = np.random.default_rng([seed, dp, len(mix)])
        plain_imb, bal_imb, bound, plain_s, bal_s, solver_ms, solver_cpu, micro = [], [], [], [], [], [], [], []
        plan_step(np.ones(dp), np.ones(dp), dp)  # warm numpy paths before timing
        for _ in range(trials):
            sizes = SampleSizes.from_lengths(make(rng, dp * per_rank))
            costs = COST.costs(sizes)
            t0, c0 = time.perf_counter(), time.thread_time()
            plan = plan_step(costs, sizes.tokens, dp, token_cap=cap)
            solver_ms.append((time.perf_counter() - t0) * 1e3)
            solver_cpu.append((time.thread_time() - c0) * 1e3)
            plain = np.bincount(plain_assignment(len(costs), dp), weights=costs, minlength=dp)
            plain_imb.append(plain.max() / plain.mean())
            bal_imb.append(plan.rank_costs.max() / plan.rank_costs.mean())
            bound.append(max(costs.max(), plain.mean()) / plain.mean())
            plain_s.append(plain.max() / FLOPS_PER_SECOND)
            bal_s.append(plan.rank_costs.max() / FLOPS_PER_SECOND)
            micro.append(plan.micro_counts.mean())
        rows.append(dict(mix=mix, dp=dp, per_rank=per_rank, plain_imb=np.mean(plain_imb), bal_imb=np.mean(bal_imb),
                         bal_worst=np.max(bal_imb), bound=np.mean(bound), plain_s=np.mean(plain_s), bal_s=np.mean(bal_s),
                         solver_ms=np.median(solver_ms), solver_max=np.max(solver_ms), solver_cpu=np.median(solver_cpu), micro=np.mean(micro)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="random steps per (mix, DP) cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run(args.trials, args.seed)
    print(f"DP balance: plain sequential split vs loongforge.core.balance.plan_step; "
          f"{args.trials} random steps per row, Llama-3-8B FLOP costs at {FLOPS_PER_SECOND / 1e12:.0f} TFLOP/s")
    header = (f"{'mix':<11}{'DP':>5}{'smp/rk':>7} | {'max/mean plain':>14}{'balanced':>9}{'(worst)':>8}{'bound':>7} | "
              f"{'eff plain':>9}{'balanced':>9} | {'step s plain':>12}{'balanced':>9}{'speedup':>8} | "
              f"{'solver ms':>9}{'(max)':>7}{'cpu':>6} | {'mb/rank':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mix']:<11}{r['dp']:>5}{r['per_rank']:>7} | {r['plain_imb']:>14.3f}{r['bal_imb']:>9.4f}"
              f"{r['bal_worst']:>8.4f}{r['bound']:>7.3f} | {1 / r['plain_imb']:>9.1%}{1 / r['bal_imb']:>9.1%} | "
              f"{r['plain_s']:>12.3f}{r['bal_s']:>9.3f}{r['plain_s'] / r['bal_s']:>7.2f}x | "
              f"{r['solver_ms']:>9.2f}{r['solver_max']:>7.2f}{r['solver_cpu']:>6.2f} | {r['micro']:>7.2f}")


if __name__ == "__main__":
    main()
