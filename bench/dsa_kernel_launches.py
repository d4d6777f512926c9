"""The sparse MLA kernels alone, per launch: forward, backward, head-mean probabilities (CUDA).

Run on a CUDA machine:  uv run python bench/dsa_kernel_launches.py [--seqs 16384,32768,65536] [--chunk 4096]

One chunk of absorbed queries (``--chunk`` tokens, the last of each ``--seqs`` sequence, as
``sparse_mla_absorbed_attention`` runs them) at DeepSeek-V3.2's sizes: 128 heads, latent 512 +
rope 64, top-2048 over causal random keys, bf16. Prints milliseconds and TFLOP/s per call: the
forward, the backward (its two kernels: the query grad, then the key grad summed over heads; with the
default blocks and with the alternatives in ``KEY_GRAD_BLOCKS`` and ``QUERY_GRAD_BLOCKS``) and
``head_mean_probs`` (the indexer loss's target) in two passes over the logits (recomputing each
head's log-sum-exp) and in one (taking the forward's). FLOPs count each matmul once: forward ``2 *
H * topk * (576 + 512)`` per query, backward ``2 * H * topk * (576 + 512 + 576 + 576 + 512)``
(logits, dP, dQ, dK, dV), head-mean probabilities ``2 * H * topk * 576`` per pass. The two
targets' largest difference is printed beside them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from loongforge.kernels import sparse_mla


# the key-grad kernel's blocks timed beside the default (``sparse_mla.HALF_BLOCKS``)
KEY_GRAD_BLOCKS = tuple(
    replace(sparse_mla.HALF_BLOCKS, dkv_heads=h, dkv_keys=n, dkv_cols=c, dkv_warps=w)
    for h, n, c, w in ((32, 64, 128, 8), (32, 128, 64, 4), (64, 128, 128, 8), (32, 128, 128, 8))
)


# the query-grad kernel's (heads, keys a step, warps, stages) timed beside the default (64, 32, 8, 1): two
# stages overlap the next key block's gather with this one's dots (ptxas at V3.2's sizes: 64 x 32 on
# wgmma in 212 KiB of shared memory, 480 bytes spilled; 32 x 64 and 32 x 32 on mma.sync, no spills)
QUERY_GRAD_BLOCKS = tuple(
    replace(sparse_mla.HALF_BLOCKS, dq_heads=h, dq_keys=n, dq_warps=w, dq_stages=st)
    for h, n, w, st in ((64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2))
)
# the forward's (keys a step, pipeline stages) timed beside the default (``sparse_mla.forward_keys``, 2)
FORWARD_BLOCKS = ((32, 2), (64, 1))
# the one-pass target's (heads, keys a step, stages) beside the default (``sparse_mla.target_blocks``)
TARGET_BLOCKS = ((64, 32, 2), (128, 32, 2))


def _ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def causal_topk(seq: int, chunk: int, topk: int, device: str) -> torch.Tensor:
    """``[1, chunk, topk]`` int32: for each of the last ``chunk`` queries, ``topk`` distinct random
    keys at or before it (-1 past the query's own position)."""
    pos = torch.arange(seq - chunk, seq, device=device)
    scores = torch.rand(chunk, seq, device=device)
    scores = scores.masked_fill(torch.arange(seq, device=device)[None, :] > pos[:, None], -1.0)
    val, idx = scores.topk(topk, dim=-1)
    return torch.where(val >= 0, idx, -1).to(torch.int32)[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="32768")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_kernel_launches: needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}: the last {args.chunk} queries of each sequence, {args.heads} heads, "
          f"top-{args.topk}, latent 512+64, bf16; ms per call")
    print("| seq | kernel | ms | TFLOP/s |")
    print("|----:|--------|---:|--------:|")
    for seq in (int(s) for s in args.seqs.split(",")):
        time_chunk(seq, args.chunk, args.heads, args.topk, args.iters)


def time_chunk(seq: int, chunk: int, h: int, topk: int, iters: int) -> None:
    d_v, d_rope = 512, 64
    scale = (128 + d_rope) ** -0.5
    torch.manual_seed(0)
    q = torch.randn(1, chunk, h, d_v + d_rope, device="cuda").to(torch.bfloat16)
    kv = torch.randn(1, seq, d_v + d_rope, device="cuda").to(torch.bfloat16)
    idx = causal_topk(seq, chunk, topk, "cuda")
    pairs = 2.0 * chunk * h * topk

    def row(name: str, ms: float, flops_per_pair: int) -> None:
        print(f"| {seq} | {name} | {ms:.2f} | {pairs * flops_per_pair / ms / 1e9:.0f} |", flush=True)

    out, lse = sparse_mla.attention_forward(q, kv, idx, scale, d_v)
    row("forward", _ms(lambda: sparse_mla.attention_forward(q, kv, idx, scale, d_v), iters), 576 + 512)
    for keys, stages in FORWARD_BLOCKS:
        ms = _ms(lambda: sparse_mla.attention_forward(q, kv, idx, scale, d_v, keys_per_step=keys, stages=stages), iters)
        row(f"forward, {keys} keys a step, {stages} stages", ms, 576 + 512)
        other, _ = sparse_mla.attention_forward(q, kv, idx, scale, d_v, keys_per_step=keys, stages=stages)
        print(f"| {seq} | forward, {keys} keys a step, largest difference | {(other - out).abs().max().item():.1e} | |")
    dout = torch.randn_like(out)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
    def backward_name(blocks) -> str:
        if blocks is None:
            return "backward"
        return (f"backward, query grad {blocks.dq_heads} heads x {blocks.dq_keys} keys, {blocks.dq_warps} warps, "
                f"{blocks.dq_stages} stages; key grad {blocks.dkv_heads} x {blocks.dkv_keys} x {blocks.dkv_cols} "
                f"columns, {blocks.dkv_warps} warps")

    choices = (None, *KEY_GRAD_BLOCKS, *QUERY_GRAD_BLOCKS)
    for blocks in choices:
        ms = _ms(lambda: sparse_mla.attention_backward(q, kv, idx, out, lse, dout, scale, d_v, dkv, blocks=blocks), iters)
        row(backward_name(blocks), ms, 576 + 512 + 576 + 576 + 512)
    grads, query_grads = [], []
    for blocks in choices:  # every block choice gives the same grads (atomics: not bit for bit)
        grads.append(torch.zeros_like(dkv))
        query_grads.append(sparse_mla.attention_backward(q, kv, idx, out, lse, dout, scale, d_v, grads[-1], blocks=blocks))
    worst = max(((g - grads[0]).norm() / grads[0].norm()).item() for g in grads[1:])
    worst_q = max(((g.float() - query_grads[0].float()).norm() / query_grads[0].float().norm()).item()
                  for g in query_grads[1:])
    print(f"| {seq} | backward block choices, largest relative difference of the key grad | {worst:.1e} | |", flush=True)
    print(f"| {seq} | backward block choices, largest relative difference of the query grad | {worst_q:.1e} | |",
          flush=True)
    row("head_mean_probs, two passes", _ms(lambda: sparse_mla.head_mean_probs(q, kv, idx, scale), iters), 2 * 576)
    natural_lse = lse * sparse_mla.LN2  # the forward's log2-domain lse as the ops return it
    row("head_mean_probs, one pass (the forward's lse)",
        _ms(lambda: sparse_mla.head_mean_probs(q, kv, idx, scale, natural_lse), iters), 576)
    diff = (sparse_mla.head_mean_probs(q, kv, idx, scale, natural_lse) - sparse_mla.head_mean_probs(q, kv, idx, scale))
    print(f"| {seq} | one pass - two passes, largest difference | {diff.abs().max().item():.2e} | |", flush=True)
    one_pass = sparse_mla.head_mean_probs(q, kv, idx, scale, natural_lse)
    for blocks in TARGET_BLOCKS:
        name = f"head_mean_probs, one pass, {blocks[0]} heads x {blocks[1]} keys, {blocks[2]} stages"
        row(name, _ms(lambda: sparse_mla.head_mean_probs(q, kv, idx, scale, natural_lse, blocks=blocks), iters), 576)
        other = sparse_mla.head_mean_probs(q, kv, idx, scale, natural_lse, blocks=blocks)
        print(f"| {seq} | {name}, largest difference | {(other - one_pass).abs().max().item():.1e} | |", flush=True)


if __name__ == "__main__":
    main()
