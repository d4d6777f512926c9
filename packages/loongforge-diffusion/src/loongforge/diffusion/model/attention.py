"""Attention over packed sequences with per-segment boundaries.

Queries ``[Tq, H, D]`` and keys/values ``[Tk, H, D]`` hold several segments back to back; segment
``s`` of the queries (``q_bounds[s]:q_bounds[s+1]``) attends only to segment ``s`` of the keys
(``k_bounds[s]:k_bounds[s+1]``). Self-attention over a pack of videos passes the same bounds twice;
cross-attention passes each video's tokens against its own prompt. Every backend computes the same
function:

- ``split``: one ``scaled_dot_product_attention`` call per segment (no mask, so SDPA may pick
  flash/efficient kernels; the loop is over the few samples of a pack);
- ``masked``: one SDPA call with a block-diagonal boolean mask (``O(Tq*Tk)`` memory);
- ``flex``: ``torch.nn.attention.flex_attention`` with a block mask built from segment ids;
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash varlen; CUDA, fp16/bf16 only);
- ``auto``: ``varlen`` on CUDA half precision, else ``split``.
"""

from __future__ import annotations

from collections.abc import Sequence
import warnings
from functools import cache

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "split", "masked", "flex", "varlen")


def _check(q_bounds: Sequence[int], k_bounds: Sequence[int], tq: int, tk: int) -> None:
    if len(q_bounds) != len(k_bounds) or len(q_bounds) < 2:
        raise ValueError(f"q_bounds and k_bounds must have the same length >= 2, got {len(q_bounds)} and {len(k_bounds)}")
    if q_bounds[0] != 0 or q_bounds[-1] != tq or k_bounds[0] != 0 or k_bounds[-1] != tk:
        raise ValueError(f"bounds must span [0, {tq}] and [0, {tk}], got {list(q_bounds)} and {list(k_bounds)}")


def _segment_ids(bounds: Sequence[int], device) -> torch.Tensor:
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def _split(q, k, v, q_bounds, k_bounds):
    outs = []
    for s in range(len(q_bounds) - 1):
        qa, qb, ka, kb = q_bounds[s], q_bounds[s + 1], k_bounds[s], k_bounds[s + 1]
        if qb == qa:
            continue
        o = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1).unsqueeze(0), k[ka:kb].transpose(0, 1).unsqueeze(0), v[ka:kb].transpose(0, 1).unsqueeze(0)
        )
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _masked(q, k, v, q_bounds, k_bounds):
    mask = _segment_ids(q_bounds, q.device)[:, None] == _segment_ids(k_bounds, q.device)[None, :]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return o.transpose(0, 1)


@cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, q_bounds, k_bounds):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_ids, k_ids = _segment_ids(q_bounds, q.device), _segment_ids(k_bounds, q.device)

    def same_segment(b, h, qi, ki):
        return q_ids[qi] == k_ids[ki]

    block_mask = create_block_mask(same_segment, None, None, q.shape[0], k.shape[0], device=q.device)
    args = (q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
    if q.is_cuda:
        o = _compiled_flex()(*args, block_mask=block_mask)
    else:  # eager flex (materialises the scores): the CPU reference path of this backend
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o = flex_attention(*args, block_mask=block_mask)
    return o.squeeze(0).transpose(0, 1)


def _varlen(q, k, v, q_bounds, k_bounds):
    from torch.nn.attention.varlen import varlen_attn

    cu_q = torch.tensor(q_bounds, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(k_bounds, dtype=torch.int32, device=q.device)
    max_q = max(b - a for a, b in zip(q_bounds[:-1], q_bounds[1:]))
    max_k = max(b - a for a, b in zip(k_bounds[:-1], k_bounds[1:]))
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "varlen" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "split"
    if backend == "varlen" and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"attention backend 'varlen' needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
    return backend


_IMPLS = {"split": _split, "masked": _masked, "flex": _flex, "varlen": _varlen}


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_bounds: Sequence[int],
    k_bounds: Sequence[int],
    backend: str = "auto",
) -> torch.Tensor:
    """Segment-wise softmax attention (scale ``1/sqrt(D)``); returns ``[Tq, H, D]``."""
    _check(q_bounds, k_bounds, q.shape[0], k.shape[0])
    return _IMPLS[resolve_backend(backend, q)](q, k, v, list(q_bounds), list(k_bounds))
