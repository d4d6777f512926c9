"""Attention over packs of several videos: flash varlen against the ``cudnn`` backend's per-sample op.

Run on a CUDA machine:  uv run python bench/pack_attention.py

Times forward + backward of ``packed_attention`` (12 heads of 128, bf16) with each backend over
packs of Wan-like sample lengths (a 480x832 frame is 1560 tokens, 33 frames 14040), for
self-attention and for cross-attention against 512-token prompts, and prints the ratio. The
``auto`` backend's threshold (``CUDNN_MIN_MEAN_SEGMENT``) comes from this table.
"""

from __future__ import annotations

import time

import torch

from loongforge.diffusion.model.attention import Segments, packed_attention

HEADS, HEAD_DIM = 12, 128
SELF_PACKS = ([1560] * 4, [1024] * 8, [2048] * 4, [3120] * 3, [7020] * 2, [14040] * 2, [14040, 3120, 1560])
CROSS_PACKS = ([14040, 14040], [1560] * 4, [7020, 7020])
PROMPT = 512


def _ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _segments(lengths: list[int]) -> Segments:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    seg = Segments(bounds)
    seg.prepare("cuda")
    return seg


def _compare(label: str, qs: Segments, ks: Segments) -> None:
    q = torch.randn(qs.bounds[-1], HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(ks.bounds[-1], HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    ms = {name: _ms(lambda: torch.autograd.grad(packed_attention(q, k, v, qs, ks, name), (q, k, v), dout))
          for name in ("varlen", "cudnn")}
    print(f"{label}: varlen {ms['varlen']:.3f} ms  cudnn {ms['cudnn']:.3f} ms  varlen/cudnn {ms['varlen'] / ms['cudnn']:.2f}x",
          flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/pack_attention.py needs a CUDA device")
    for lengths in SELF_PACKS:
        seg = _segments(lengths)
        _compare(f"self {lengths}", seg, seg)
    for lengths in CROSS_PACKS:
        _compare(f"cross {lengths} x {PROMPT}", _segments(lengths), _segments([PROMPT] * len(lengths)))


if __name__ == "__main__":
    main()
