"""Core attention for multi-latent attention on megatron-core's local (Transformer-Engine-free) backend.

MLA's queries and keys have ``qk_nope + qk_rope`` dims per head and its values ``v_head_dim``;
megatron-core's MLA hands its core attention ``k_channels``/``v_channels``, which only the
Transformer Engine implementation accepts. ``LatentDotProductAttention`` is megatron's local
``DotProductAttention`` taking them: its matmuls already follow the tensors' own head dims,
only the output width (heads x value dim) is set from ``v_channels``.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class LatentDotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if softmax_scale is None and k_channels is not None:
            self.softmax_scale = k_channels**-0.5
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
