"""Attention over packed sequences with per-segment boundaries.

Queries ``[Tq, H, D]`` and keys/values ``[Tk, H, D]`` hold several segments back to back; segment
``s`` of the queries (``q.bounds[s]:q.bounds[s+1]``) attends only to segment ``s`` of the keys.
Self-attention over a pack of videos passes the same segments twice; cross-attention passes each
video's tokens against its own prompt. Every backend computes the same function:

- ``split``: one ``scaled_dot_product_attention`` call per segment (no mask, so SDPA picks its
  fastest kernel: cuDNN attention on Hopper/Blackwell, flash elsewhere; the loop is over the few
  samples of a pack);
- ``masked``: one SDPA call with a block-diagonal boolean mask (``O(Tq*Tk)`` memory);
- ``flex``: ``torch.nn.attention.flex_attention`` with a block mask built from segment ids
  (compiled on CUDA; eager, i.e. materialising the scores, elsewhere);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash varlen; CUDA, fp16/bf16 only);
- ``cudnn``: cuDNN's flash attention segment by segment inside one custom op
  (``segment_attention.py``; CUDA, fp16/bf16 only), so compiled code does not specialise on the
  pack's layout;
- ``auto``: on CUDA half precision, one SDPA call when queries and keys are single segments (a
  pack of one video: the same kernel a plain diffusers step gets); for a pack of several,
  ``cudnn`` where the segments were prepared for a Hopper-or-newer GPU and queries and keys are
  long on average (:data:`CUDNN_MIN_MEAN_SEGMENT` tokens: self-attention over long videos), else
  ``varlen``; ``split`` elsewhere.

A ``Segments`` object caches what a backend derives from the bounds (cumulative lengths on the
device, the bounds as a host tensor, masks), so the layers of one forward build them once.
``Segments(bounds, exact=False)`` hands ``varlen`` the packed lengths as maximum segment lengths (valid upper bounds: the kernel
only launches some idle tiles more). A compiled caller uses it, builds the device caches before
entering compiled code and skips the bounds check there, so compiled code reads no bound and does
not specialise on each pack's layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from loongforge.diffusion.model.query_chunks import (as_query_chunks, from_query_chunks, heads_first, key_copies,
                                                     query_chunks)

BACKENDS = ("auto", "split", "masked", "flex", "varlen", "cudnn")

# ``auto`` runs a pack through ``cudnn`` when its query and key segments are at least this long on
# average. On an H200 (12 heads of 128, forward + backward) the per-segment loop measured 1.57x
# faster than flash varlen for 2 x 7020 and 2 x 14040 tokens, 1.09x for 3 x 3120, and 2.5-4x
# slower for 4 x 1560 or 8 x 1024 tokens and for cross-attention to 512-token prompts.
CUDNN_MIN_MEAN_SEGMENT = 4096


@dataclass(eq=False)
class Segments:
    """Segment boundaries ``[0, b1, ..., T]`` plus per-device caches derived from them."""

    bounds: list[int]
    exact: bool = True  # False: varlen takes the packed length as the maximum segment length
    cache: dict = field(default_factory=dict, repr=False)
    single: bool = field(init=False)
    prefer_cudnn: bool = field(init=False, default=False)  # set by prepare(): what ``auto`` picks for a pack

    def __post_init__(self):
        self.single = len(self.bounds) == 2

    def prepare(self, device) -> None:
        """Build, outside compiled code, what the CUDA backends read (cumulative lengths on the
        device, host bounds) and decide whether ``auto`` runs a pack of these segments on cuDNN
        (Hopper or newer, long segments on average)."""
        device = torch.device(device)
        self.cu(device)
        self.host_bounds()
        long = self.bounds[-1] >= CUDNN_MIN_MEAN_SEGMENT * (len(self.bounds) - 1)
        self.prefer_cudnn = long and torch.cuda.get_device_capability(device) >= (9, 0)

    @property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    def cu(self, device) -> torch.Tensor:
        """Cumulative lengths as int32 on ``device`` (copied once, without a host sync)."""
        key = ("cu", str(device))
        if key not in self.cache:
            t = torch.tensor(self.bounds, dtype=torch.int32)
            if torch.device(device).type == "cuda":
                t = t.pin_memory()
            self.cache[key] = t.to(device, non_blocking=True)
        return self.cache[key]

    def host_bounds(self) -> torch.Tensor:
        """The bounds as a host int64 tensor (what the ``cudnn`` backend's op takes)."""
        if "host" not in self.cache:
            self.cache["host"] = torch.tensor(self.bounds, dtype=torch.int64)
        return self.cache["host"]

    def ids(self, device) -> torch.Tensor:
        """Segment index of every position, on ``device``."""
        key = ("ids", str(device))
        if key not in self.cache:
            lengths = torch.tensor([b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])])
            self.cache[key] = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
        return self.cache[key]


def as_segments(s: Segments | Sequence[int]) -> Segments:
    return s if isinstance(s, Segments) else Segments(list(s))


def _check(q: Segments, k: Segments, tq: int, tk: int) -> None:
    if len(q.bounds) != len(k.bounds) or len(q.bounds) < 2:
        raise ValueError(f"query and key segments must have the same count >= 1, got bounds {q.bounds} and {k.bounds}")
    if q.bounds[0] != 0 or q.bounds[-1] != tq or k.bounds[0] != 0 or k.bounds[-1] != tk:
        raise ValueError(f"bounds must span [0, {tq}] and [0, {tk}], got {q.bounds} and {k.bounds}")


def _sdpa(q, k, v) -> torch.Tensor:
    """One segment: ``[T, H, D]`` viewed as ``[1, H, T, D]`` (the layout diffusers hands SDPA).

    With many more queries than keys the queries become a batch of chunks against copies of the
    keys: a flash backward parallelises over key blocks, so a 512-token prompt gives it only 8
    blocks per head for 14k queries; as a batch of 8 it runs 8x the programs (on an H200,
    cross-attention forward + backward 0.77 -> 0.59 ms at Wan-1.3B's shape). The outputs are the
    same; the key/value grads are summed over the chunks."""
    chunks = query_chunks(q.shape[0], k.shape[0])
    out = F.scaled_dot_product_attention(as_query_chunks(q, chunks), key_copies(k, chunks), key_copies(v, chunks))
    return from_query_chunks(out, q.shape[0])


def _split(q, k, v, qs: Segments, ks: Segments):
    if qs.single and ks.single:
        return _sdpa(q, k, v)
    outs = []
    for s in range(len(qs.bounds) - 1):
        qa, qb, ka, kb = qs.bounds[s], qs.bounds[s + 1], ks.bounds[s], ks.bounds[s + 1]
        if qb == qa:
            continue
        outs.append(_sdpa(q[qa:qb], k[ka:kb], v[ka:kb]))
    return torch.cat(outs, dim=0) if outs else q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _masked(q, k, v, qs: Segments, ks: Segments):
    key = ("mask", id(ks), str(q.device))
    if key not in qs.cache:
        qs.cache[key] = qs.ids(q.device)[:, None] == ks.ids(q.device)[None, :]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=qs.cache[key])
    return o.transpose(0, 1)


@cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q, k, v, qs: Segments, ks: Segments):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    key = ("flex", id(ks), str(q.device))
    if key not in qs.cache:
        q_ids, k_ids = qs.ids(q.device), ks.ids(q.device)

        def same_segment(b, h, qi, ki):
            return q_ids[qi] == k_ids[ki]

        qs.cache[key] = create_block_mask(same_segment, None, None, q.shape[0], k.shape[0], device=q.device)
    args = (heads_first(q), heads_first(k), heads_first(v))
    if q.is_cuda:
        o = _compiled_flex()(*args, block_mask=qs.cache[key])
    else:  # eager flex (materialises the scores): the CPU reference path of this backend
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o = flex_attention(*args, block_mask=qs.cache[key])
    return o.squeeze(0).transpose(0, 1)


def _varlen(q, k, v, qs: Segments, ks: Segments):
    from torch.nn.attention.varlen import varlen_attn

    max_q = qs.max_len if qs.exact else q.shape[0]
    max_k = ks.max_len if ks.exact else k.shape[0]
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), qs.cu(q.device), ks.cu(q.device), max_q, max_k)


def _cudnn(q, k, v, qs: Segments, ks: Segments):
    from loongforge.diffusion.model.segment_attention import segment_attention

    return segment_attention(q, k, v, qs.host_bounds(), ks.host_bounds())[0]


def resolve_backend(backend: str, q: torch.Tensor, qs: Segments, ks: Segments) -> str:
    """The implementation ``backend`` runs for queries ``q`` in segments ``qs`` against keys in ``ks``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: one of {', '.join(BACKENDS)}")
    half_cuda = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        if not half_cuda or (qs.single and ks.single):
            return "split"
        return "cudnn" if qs.prefer_cudnn and ks.prefer_cudnn else "varlen"
    if backend in ("varlen", "cudnn") and not half_cuda:
        raise ValueError(f"attention backend {backend!r} needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
    return backend


_IMPLS = {"split": _split, "masked": _masked, "flex": _flex, "varlen": _varlen, "cudnn": _cudnn}


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_segments: Segments | Sequence[int],
    k_segments: Segments | Sequence[int],
    backend: str = "auto",
) -> torch.Tensor:
    """Segment-wise softmax attention (scale ``1/sqrt(D)``); returns ``[Tq, H, D]``."""
    qs, ks = as_segments(q_segments), as_segments(k_segments)
    if not torch.compiler.is_compiling():  # compiled callers built the segments from the pack
        _check(qs, ks, q.shape[0], k.shape[0])
    return _IMPLS[resolve_backend(backend, q, qs, ks)](q, k, v, qs, ks)
