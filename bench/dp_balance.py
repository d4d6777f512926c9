"""DP load balancing: the balancer against the plain split and two textbook partitioning baselines,
simulated at DP 8 / 64 / 512 and measured in a 2-process gloo run on CPU.

Assignments of one step's samples to the DP ranks:
  plain     the contiguous split a distributed sampler makes (each rank takes the next
            samples_per_step / DP samples of the shuffled step)
  lpt       largest-first greedy (``bench/balance_baselines.py``: ``lpt_assignment``)
  kk        multiway Karmarkar-Karp differencing (``karmarkar_karp_assignment``; O(n x DP), so only
            up to DP 64, "-" above)
  balanced  ``loongforge.core.balance.plan_step`` (which also packs micro-batches under a token cap)

Scores. Each plan is made with one cost model, the FLOP formula of a Llama-3-8B-shaped model
(``transformer_cost_model``), and scored under it and under a perturbed model in which attention
runs at half the GEMM efficiency (its quadratic term doubled): a plan tuned to the wrong costs.
A compute-bound step lasts as long as its most loaded rank, so

    imbalance = max / mean rank cost, scaling efficiency = mean / max = 1 / imbalance;

the step seconds are the max rank cost at an assumed 400 TFLOP/s per GPU. "bound" is the best
max/mean any assignment can reach without splitting a sample. "solver ms" is the wall time of one
plan_step call (median), "mb/rank" the mean number of micro-batches per rank.

Length mixes (samples per rank per step, micro-batch token cap):
  text-sft    chat SFT, lognormal lengths (median 700, sigma 1.0), 32..16K tokens
  image-text  text (median 200) + images of 256-1,280 tokens each: one image in 80% of samples,
              two in 12%, three or four in the rest
  video       8K-100K tokens (log-uniform) + a short prompt
  mixed       70% text-sft, 25% image-text, 5% video in one step

Measured: the "mixed" lengths scaled down 32x, run by 2 gloo processes on CPU
(``bench/cpu_step_times.py``: GEMMs linear in the length, attention quadratic,
an all-reduce ending each step), the plain split, LPT and the balanced sampler taking turns step by
step; median and mean step seconds. On a shared or busy machine these times are noisy.

Usage: uv run python bench/dp_balance.py [--trials 5] [--seed 0] [--measured-steps 8] [--no-measured]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm.auto import tqdm

from loongforge.core.balance import CostModel, SampleSizes, plan_step, transformer_cost_model
from loongforge.core.balance.assign import plain_assignment
from balance_baselines import karmarkar_karp_assignment, lpt_assignment

FLOPS_PER_SECOND = 400e12  # achieved bf16 throughput per GPU assumed for the simulated seconds
COST = transformer_cost_model(hidden_size=4096, num_layers=32, ffn_hidden_size=14336, num_attention_heads=32,
                              num_query_groups=8, vocab_size=128256)
PERTURBED = CostModel(a=2 * COST.a, b=COST.b, c=COST.c)  # attention at half the GEMM efficiency
DP_SIZES = (8, 64, 512)
KK_MAX_DP = 64
IMAGES_PER_SAMPLE = ([1, 2, 3, 4], [0.80, 0.12, 0.05, 0.03])


def text_sft(rng, n):
    return np.clip(rng.lognormal(np.log(700), 1.0, n), 32, 16384).astype(np.int64)


def image_text(rng, n):
    text = np.clip(rng.lognormal(np.log(200), 0.8, n), 16, 4096)
    images = rng.choice(IMAGES_PER_SAMPLE[0], size=n, p=IMAGES_PER_SAMPLE[1])
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


def imbalances(rank_of: np.ndarray, dp: int, *costs: np.ndarray) -> list[float]:
    """max / mean rank cost of one assignment under each of ``costs``."""
    out = []
    for c in costs:
        loads = np.bincount(rank_of, weights=c, minlength=dp)
        out.append(loads.max() / loads.mean())
    return out


def run(trials: int, seed: int) -> list[dict]:
    rows = []
    configs = [(mix, dp) for mix in MIXES for dp in DP_SIZES]
    for mix, dp in tqdm(configs, desc="dp_balance", leave=False):
        make, per_rank, cap = MIXES[mix]
        rng = np.random.default_rng([seed, dp, len(mix)])
        cells: dict[str, list] = {}
        plan_step(np.ones(dp), np.ones(dp), dp)  # warm numpy paths before timing
        for _ in range(trials):
            sizes = SampleSizes.from_lengths(make(rng, dp * per_rank))
            costs, perturbed = COST.costs(sizes), PERTURBED.costs(sizes)
            t0 = time.perf_counter()
            plan = plan_step(costs, sizes.tokens, dp, token_cap=cap)
            cells.setdefault("solver_ms", []).append((time.perf_counter() - t0) * 1e3)
            assignments = {"plain": plain_assignment(len(costs), dp), "lpt": lpt_assignment(costs, dp),
                           "balanced": plan.rank}
            if dp <= KK_MAX_DP:
                assignments["kk"] = karmarkar_karp_assignment(costs, dp)
            for name, rank_of in assignments.items():
                nominal, off = imbalances(rank_of, dp, costs, perturbed)
                cells.setdefault(name, []).append(nominal)
                cells.setdefault(name + "_perturbed", []).append(off)
                loads = np.bincount(rank_of, weights=costs, minlength=dp)
                cells.setdefault(name + "_s", []).append(loads.max() / FLOPS_PER_SECOND)
            cells.setdefault("bound", []).append(max(costs.max(), costs.sum() / dp) / (costs.sum() / dp))
            cells.setdefault("micro", []).append(plan.micro_counts.mean())
        row = {k: float(np.median(v) if k == "solver_ms" else np.mean(v)) for k, v in cells.items()}
        rows.append(dict(mix=mix, dp=dp, per_rank=per_rank, **row))
    return rows


def measured(steps: int, seed: int) -> dict[str, list[float]]:
    """Step seconds of the plain split, LPT and the balanced sampler, 2 gloo processes on CPU."""
    from cpu_step_times import measure_step_times

    samples_per_step = 32
    rng = np.random.default_rng([seed, 2])
    lengths = np.maximum(mixed(rng, samples_per_step * steps) // 32, 4)
    return measure_step_times(lengths, samples_per_step, steps, world=2)


def fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="random steps per (mix, DP) cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measured-steps", type=int, default=8, help="steps of the 2-process gloo run")
    parser.add_argument("--no-measured", action="store_true", help="skip the 2-process gloo run")
    args = parser.parse_args()
    rows = run(args.trials, args.seed)
    print(f"DP balance: plain split, LPT, Karmarkar-Karp (DP <= {KK_MAX_DP}) and plan_step; {args.trials} random "
          f"steps per row, Llama-3-8B FLOP costs at {FLOPS_PER_SECOND / 1e12:.0f} TFLOP/s; max/mean rank cost under "
          f"the planning model and (perturbed) with attention at half the GEMM efficiency")
    names = ("plain", "lpt", "kk", "balanced")
    header = (f"{'mix':<11}{'DP':>5}{'smp/rk':>7} | " + "".join(f"{n:>9}" for n in names) + f"{'bound':>7} | "
              + "".join(f"{n + '*':>10}" for n in names) + f" | {'step s plain':>12}{'lpt':>7}{'balanced':>9}"
              f"{'x plain':>8}{'x lpt':>7} | {'solver ms':>9} | {'mb/rank':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mix']:<11}{r['dp']:>5}{r['per_rank']:>7} | " + "".join(f"{fmt(r, n, '.4f'):>9}" for n in names)
              + f"{r['bound']:>7.3f} | " + "".join(f"{fmt(r, n + '_perturbed', '.4f'):>10}" for n in names)
              + f" | {r['plain_s']:>12.3f}{r['lpt_s']:>7.3f}{r['balanced_s']:>9.3f}"
              f"{r['plain_s'] / r['balanced_s']:>7.2f}x{r['lpt_s'] / r['balanced_s']:>6.3f}x | "
              f"{r['solver_ms']:>9.2f} | {r['micro']:>7.2f}")
    print("(* scored under the perturbed cost model; the plans were made with the planning model)")
    if not args.no_measured:
        times = measured(args.measured_steps, args.seed)
        print(f"\nmeasured, 2 gloo processes on CPU, {args.measured_steps} steps of 32 'mixed' samples (lengths / 32):")
        for name, values in times.items():
            print(f"  {name:<9} median {np.median(values) * 1e3:8.1f} ms/step   mean {np.mean(values) * 1e3:8.1f}")
        base = {n: np.mean(v) for n, v in times.items()}
        print(f"  mean step time: plain / balanced {base['plain'] / base['balanced']:.2f}x, "
              f"lpt / balanced {base['lpt'] / base['balanced']:.2f}x")


if __name__ == "__main__":
    main()
