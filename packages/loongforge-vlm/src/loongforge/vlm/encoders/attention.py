"""Core attention of a ViT layer over a packed sequence of independent segments.

All images (and video frames) of a micro-batch go through the encoder as one sequence; a
patch attends only to patches of its own segment: its frame for full-attention layers, its
window for window-attention layers. megatron-core's local ``DotProductAttention`` takes one
dense mask for every layer and its packed-sequence path needs Transformer Engine, so the ViT
layer specs put this module in the ``core_attention`` slot instead.

The block passes the segmentation as the ``attention_mask`` argument: an integer tensor of
shape ``[2, s]`` holding each patch's frame id (row ``FULL``) and window id (row ``WINDOW``).
Each layer's spec says which row it reads. A tensor (not a Python object) keeps megatron's
activation recompute, which saves the mask for the backward pass, working. Ids are
non-decreasing: every segment is one contiguous run (frames are laid out one after the other,
and the encoder permutes the patches so that each window is contiguous too).

Two kernels compute the same thing. On CUDA in bf16/fp16, torch's variable-length flash
attention (``torch.nn.attention.varlen``) runs over the segment boundaries (``cu_seqlens`` and the
longest segment): memory linear in the sequence, and a window layer computes only the pairs within
windows. The encoder finds both rows' boundaries once a forward (``SegmentBounds.of``, one host
read a row) and hands them to every layer through the block's ``packed_seq_params``; without them a
layer finds its row's itself, a host sync per layer. Elsewhere (CPU, fp32, attention dropout) one
SDPA call with a dense ``[s, s]`` same-segment mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

FULL = 0
WINDOW = 1


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment index of every position of a packed sequence with boundaries ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if ids.numel() != total:
        raise ValueError(f"segments cover {ids.numel()} positions, the sequence has {total}")
    return ids


def segment_cu_seqlens(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, longest)`` of a sequence segmented by non-decreasing ids: the int32
    boundaries of its runs of equal ids (on the ids' device) and the longest run's length.

    The inverse of ``segment_ids`` up to the ids' values. One host sync (the run count and the
    longest run are needed on the host by the variable-length kernel)."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"segment ids must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    host = torch.stack([values.long(), counts.long()]).cpu()
    if not bool((host[0, 1:] > host[0, :-1]).all()):
        raise ValueError(f"segment ids must be non-decreasing (each segment one contiguous run); runs of ids "
                         f"{host[0].tolist()[:16]}")
    cu_seqlens = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return cu_seqlens, int(host[1].max())


@dataclass
class SegmentBounds(PackedSeqParams):
    """Both segmentations' ``(cu_seqlens, longest)`` (rows ``FULL`` and ``WINDOW``) for one forward
    of the encoder's block, passed as its ``packed_seq_params``. ``qkv_format`` is ``"sbhd"``, so
    megatron's attention keeps its layout and rotary path; only ``SegmentAttention`` reads ``rows``."""

    rows: tuple[tuple[torch.Tensor, int], ...] = ()

    @classmethod
    def of(cls, segments: torch.Tensor) -> SegmentBounds:
        """The boundaries of each row of the ``[2, s]`` segment ids."""
        return cls(qkv_format="sbhd", rows=tuple(segment_cu_seqlens(ids) for ids in segments))


def _varlen_attn():
    """torch's variable-length flash attention, where this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


class SegmentAttention(MegatronModule):
    """Softmax attention within segments, ``[s, b, heads, d] -> [s, b, heads * d]``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None,
                 segment_row: int = FULL, **unused):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("the vision encoder does not support context parallelism")
        self.segment_row = segment_row
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is None or attention_mask.dim() != 2:
            raise ValueError("SegmentAttention needs the [2, s] segment ids as attention_mask")
        if (packed_seq_params is not None and not isinstance(packed_seq_params, SegmentBounds)) \
                or attention_bias is not None:
            raise ValueError("SegmentAttention takes no attention_bias, and as packed_seq_params only SegmentBounds")
        ids = attention_mask[self.segment_row]
        dropout = self.dropout if self.training else 0.0
        if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0:
            varlen = _varlen_attn()
            if varlen is not None:
                return self._varlen(varlen, query, key, value, ids, packed_seq_params)
        return self._masked(query, key, value, ids, dropout)

    def _varlen(self, varlen, query, key, value, ids, bounds: SegmentBounds | None = None):
        """Flash attention within the runs of ``ids`` (their boundaries from ``bounds`` where given);
        the ``b`` rows are folded into one packed sequence (row ``i``'s boundaries shifted by ``i * s``)."""
        s, b = query.shape[:2]
        cu_seqlens, longest = bounds.rows[self.segment_row] if bounds is not None else segment_cu_seqlens(ids)
        if b > 1:
            shifts = torch.arange(b, device=cu_seqlens.device, dtype=torch.int32)[:, None] * s
            cu_seqlens = torch.cat([(cu_seqlens[:-1] + shifts).flatten(), cu_seqlens[-1:] + (b - 1) * s])

        def packed(t):  # [s, b, h, d] -> [b * s, h, d]; a copy only for a strided view (megatron's value)
            return t.transpose(0, 1).reshape(b * s, *t.shape[2:]).contiguous()

        out = varlen(packed(query), packed(key), packed(value), cu_seqlens, cu_seqlens, longest, longest,
                     scale=self.softmax_scale)
        return out.reshape(b, s, self.heads * query.shape[-1]).transpose(0, 1).contiguous()

    def _masked(self, query, key, value, ids, dropout: float):
        """One SDPA call with the dense same-segment mask ``[1, 1, s, s]``."""
        allowed = (ids[:, None] == ids[None, :])[None, None]  # True: attend
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale, dropout_p=dropout)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * q.shape[-1])
