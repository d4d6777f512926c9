"""Core attention of a ViT layer over a packed sequence of independent segments.

All images (and video frames) of a micro-batch go through the encoder as one sequence; a
patch attends only to patches of its own segment: its frame for full-attention layers, its
window for window-attention layers. megatron-core's local ``DotProductAttention`` takes one
dense mask for every layer and its packed-sequence path needs Transformer Engine, so the ViT
layer specs put this module in the ``core_attention`` slot instead.

The block passes the segmentation as the ``attention_mask`` argument: an integer tensor of
shape ``[2, s]`` holding each patch's frame id (row ``FULL``) and window id (row ``WINDOW``).
Each layer's spec says which row it reads. A tensor (not a Python object) keeps megatron's
activation recompute, which saves the mask for the backward pass, working.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SegmentAttention takes neither packed_seq_params nor attention_bias")
        ids = attention_mask[self.segment_row]
        allowed = (ids[:, None] == ids[None, :])[None, None]  # [1, 1, s, s], True: attend
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * q.shape[-1])
