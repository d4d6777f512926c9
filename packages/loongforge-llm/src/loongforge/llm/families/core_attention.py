"""Core attention for multi-latent attention without Transformer Engine.

MLA's queries and keys have ``qk_nope + qk_rope`` dims per head and its values ``v_head_dim``;
megatron-core's MLA hands its core attention ``k_channels``/``v_channels``, which only the
Transformer Engine implementation accepts. ``LatentSDPAttention`` is the fast path's
``SDPAttention`` taking them: SDPA already follows the tensors' own head dims (the value's may
differ from the query's), so only the softmax scale (from the query/key dim, unless MLA gives
its own, e.g. YaRN's) and the output width (heads x value dim) change.

Under tensor parallelism it also sums the gradient of the keys' rope part over TP. That part is
one ``qk_pos_emb_head_dim`` vector per token shared by every head; megatron's local MLA computes it
with a column-parallel ``linear_kv_down_proj`` and all-gathers the result over TP
(``gather_from_tensor_model_parallel_region``, whose backward only takes this rank's slice), so
without the sum each TP rank's slice of the down projection (and the norm before it) would learn
from its own heads' share of the gradient only. The latent part needs nothing: the column-parallel
``linear_kv_up_proj`` after it sums its input's gradient over TP.
"""

from __future__ import annotations

import torch

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
        self.rope_dim = getattr(config, "qk_pos_emb_head_dim", 0)

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        return super().forward(query, self._rope_key_summed_over_tp(key), value, attention_mask, *args, **kwargs)

    def _rope_key_summed_over_tp(self, key: torch.Tensor) -> torch.Tensor:
        """``key`` whose last ``rope_dim`` entries (the shared rope key) have their gradient summed
        over TP (see the module docstring)."""
        if not self.rope_dim:
            return key
        return tail_grad_summed_over_tp(key, key.shape[-1] - self.rope_dim, self.tp_group)


def tail_grad_summed_over_tp(t: torch.Tensor, start: int, tp_group) -> torch.Tensor:
    """``t`` as it is (forward), whose entries ``start:`` of the last dim get their gradient summed
    over ``tp_group`` (megatron's ``copy_to_tensor_model_parallel_region``): for a tensor every TP
    rank holds whole but whose gradient each rank's heads give only their share of."""
    if tp_group.size() == 1:
        return t
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return torch.cat([t[..., :start], copy_to_tensor_model_parallel_region(t[..., start:], group=tp_group)], -1)
