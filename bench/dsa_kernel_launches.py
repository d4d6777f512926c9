"""The sparse MLA kernels alone, per launch: forward, backward, head-mean probabilities (CUDA).

Run on a CUDA machine:  uv run python bench/dsa_kernel_launches.py [--seqs 16384,32768,65536] [--chunk 4096]

One chunk of absorbed queries (``--chunk`` tokens, the last of each ``--seqs`` sequence, as
``sparse_mla_absorbed_attention`` runs them) at DeepSeek-V3.2's sizes: 128 heads, latent 512 +
rope 64, top-2048 over causal random keys, bf16. Prints milliseconds and TFLOP/s per kernel: the
forward, each backward launch of ``sparse_mla.BACKWARD_LAUNCHES`` (two kernels) and the single-kernel
``per_head_block`` form, and ``head_mean_probs`` (the indexer loss's target). FLOPs count each
matmul once: forward ``2 * H * topk * (576 + 512)`` per query, backward ``2 * H * topk * (576 +
512 + 576 + 576 + 512)`` (logits, dP, dQ, dK, dV), head-mean probabilities ``2 * H * topk * 576``.
"""

from __future__ import annotations

import argparse
import time

import torch

from loongforge.kernels import sparse_mla


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
    parser.add_argument("--launch", action="append", default=[], metavar="NAME=dq_h,dq_n,warps,stages,form,h,n,warps,stages",
                        help="also time this backward launch (a sparse_mla.BackwardLaunch's fields in order)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_kernel_launches: needs a CUDA device")
    launches = [(name, "head_summed", name) for name in sparse_mla.BACKWARD_LAUNCHES]
    for spec in args.launch:
        name, fields = spec.split("=")
        values = [v if v.isalpha() or "_" in v else int(v) for v in fields.split(",")]
        launches.append((name, "head_summed", sparse_mla.BackwardLaunch(*values)))
    launches.append(("per_head_block (one kernel)", "per_head_block", sparse_mla.DEFAULT_BACKWARD))
    print(f"# {torch.cuda.get_device_name()}: the last {args.chunk} queries of each sequence, {args.heads} heads, "
          f"top-{args.topk}, latent 512+64, bf16; ms per call of each kernel launch")
    print("| seq | kernel | ms | TFLOP/s |")
    print("|----:|--------|---:|--------:|")
    for seq in (int(s) for s in args.seqs.split(",")):
        time_chunk(seq, args.chunk, args.heads, args.topk, args.iters, launches)


def time_chunk(seq: int, chunk: int, h: int, topk: int, iters: int, launches: list) -> None:
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
    dout = torch.randn_like(out)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
    want = None
    for label, key_grad, launch in launches:
        def backward():
            return sparse_mla.attention_backward(q, kv, idx, out, lse, dout, scale, d_v, dkv, key_grad, launch)
        try:
            ms = _ms(backward, iters)
        except Exception as exc:  # a launch that does not compile on this GPU: say so and go on
            print(f"| {seq} | backward {label} | failed: {str(exc).splitlines()[0][:100]} | - |", flush=True)
            continue
        dkv.zero_()
        got = (backward().float(), dkv.clone())
        want = got if want is None else want
        err = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
        row(f"backward {label} (rel. diff to the first: {err:.1e})", ms, 576 + 512 + 576 + 576 + 512)
    row("head_mean_probs", _ms(lambda: sparse_mla.head_mean_probs(q, kv, idx, scale), iters), 2 * 576)


if __name__ == "__main__":
    main()
