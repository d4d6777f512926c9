"""Core attention for multi-latent attention without Transformer Engine.

MLA's queries and keys have ``qk_nope + qk_rope`` dims per head and its values ``v_head_dim``;
megatron-core's MLA hands its core attention ``k_channels``/``v_channels``, which only the
Transformer Engine implementation accepts. ``LatentSDPAttention`` is the fast path's
``SDPAttention`` taking them: SDPA already follows the tensors' own head dims (the value's may
differ from the query's), so only the softmax scale (from the query/key dim, unless MLA gives
its own, e.g. YaRN's) and the output width (heads x value dim) change.
"""

from __future__ import annotations

from loongforge.llm.layers.attention import SDPAttention


class LatentSDPAttention(SDPAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale if softmax_scale is not None or k_channels is None else k_channels**-0.5,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            self.head_dim = v_channels  # the output is heads x value dim
