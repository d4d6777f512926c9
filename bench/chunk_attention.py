"""Causal attention of a chunk of queries against the keys of the whole prefix (ChunkPipe's and
context parallelism's shape), forward + backward on a CUDA device: SDPA with torch's lower-right
causal bias, with grouped K/V heads (``enable_gqa``) and with the K/V heads repeated, against
plain causal SDPA over the same number of keys (the whole sequence's cost, for scale).

    python bench/chunk_attention.py --seq 32768 --chunk 4096 --heads 16 --groups 4 --head-dim 128
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(1, args.heads, args.chunk, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, args.groups, args.seq, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    rep = args.heads // args.groups
    kr = k.detach().repeat_interleave(rep, 1).requires_grad_()
    vr = v.detach().repeat_interleave(rep, 1).requires_grad_()
    qf = torch.randn(1, args.heads, args.seq, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    bias = causal_lower_right(args.chunk, args.seq)
    cases = {
        "lower-right, enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
        "lower-right, K/V repeated": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias),
        "causal square, whole sequence, enable_gqa": lambda: F.scaled_dot_product_attention(qf, k, v, is_causal=True,
                                                                                          enable_gqa=True),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; chunk {args.chunk} of {args.seq}, "
          f"{args.heads} heads / {args.groups} K/V groups x {args.head_dim}")
    for name, fn in cases.items():
        ms = timed(lambda fn=fn: fn().sum().backward(), args.iters)
        print(f"{name:45s} {ms:9.2f} ms fwd+bwd")


if __name__ == "__main__":
    main()
