"""megatron's ``SelfAttention`` with the registry's fused RoPE and no extra copies of q/k/v.

megatron splits the ``linear_qkv`` output (per query group ``[q heads, k, v]``) into views,
copies the queries into ``[s, b, heads, d]``, then applies rotary in several elementwise passes.
Here the registry's ``grouped_qkv_rope`` op reads each token's ``linear_qkv`` row once and writes
the rotated queries and keys and the values contiguous, in the layout SDPA reads, and its backward
writes the ``linear_qkv`` gradient in one pass; nothing keeps the ``linear_qkv`` output alive for the
backward. With q/k norms (Qwen3: plain RMSNorms, ``FusedRMSNorm``) the registry's
``grouped_qkv_norm_rope`` does the per-head norms in the same pass (and their backward, with the
norm weights' gradients, in the backward's); other q/k norms run between the split and the
rotation: the fused ``rope`` op then reads the normed queries and keys and the values get one
contiguous copy. With
megatron's output gate (``attention_output_gate``, Qwen3.5: ``linear_qkv`` holds per query group
the query heads, their gates, the key and the value) the attention output is scaled by
``sigmoid(gate)`` before ``linear_proj``, as megatron does. Inference, cross attention,
interleaved rotary and TP ranks holding partial query groups take megatron's own path.

Under context parallelism (``context_parallel_size > 1``) only this class's own path runs (the
others are refused): the model hands it the whole sequence's RoPE angles (``gpt_model``) and each
local token is rotated by its global position (``rope_tables``; a packed row's positions are kept on
its forward's ``GatheredLayout``, ``packed_params``, one host read per forward); the core attention
(``attention.SDPAttention``) attends over the whole sequence of the CP group.

Under ChunkPipe (``train.seq_chunks > 1``, ``chunk_pipe``) the runner sets ``chunk_state`` for the
chunk it runs: the layer rotates its queries and keys by their positions in the whole sequence and
attends over the keys and values of the chunks before it plus its own (causal, aligned to the
last key), handing its own keys and values to the state for the chunks after it.

With multimodal RoPE (``config.mrope_section`` set: megatron's ``MultimodalRotaryEmbedding``) the
angles hold one row per token of this layer's input, computed from each token's own position
(packed or split across CP ranks by the caller), and are used as they are (``rope_tables``).

The cos/sin tables of a forward's angles are the same in every layer: ``share_rope_tables`` gives all
the ``FusedSelfAttention`` layers of one model one ``RopeTables`` (the model builders call it), so
the first layer builds them and the others reuse them; a layer outside such a model keeps its own.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.layers.chunk_attention_state import ChunkAttentionState
from loongforge.llm.layers.norm import FusedRMSNorm
from loongforge.llm.layers.packed_params import forward_layout
from loongforge.llm.layers.rope_tables import RopeTables


class FusedSelfAttention(SelfAttention):
    """``kernels``: the policy its ``rope`` is resolved by; ``rope_tables``: the cos/sin tables of
    the current forward's angles, this layer's own until ``share_rope_tables`` gives it its model's."""

    def __init__(self, *args, kernels: KernelPolicy = KernelPolicy(), **kwargs):
        super().__init__(*args, **kwargs)
        self._rope = kernels.get("rope")
        self._grouped_qkv_rope = kernels.get("grouped_qkv_rope")
        self._grouped_qkv_norm_rope = kernels.get("grouped_qkv_norm_rope")
        # both q/k norms plain RMSNorms of one epsilon: what grouped_qkv_norm_rope computes (not a subclass:
        # ZeroCenteredRMSNorm scales by 1 + weight)
        q, k = self.q_layernorm, self.k_layernorm
        self._norms_in_qkv_pass = type(q) is FusedRMSNorm and type(k) is FusedRMSNorm and q.eps == k.eps
        self.rope_tables = RopeTables()
        self._cp = (self.pg_collection.cp.size(), self.pg_collection.cp.rank())
        self.chunk_state: ChunkAttentionState | None = None  # ChunkPipe: the chunk running now
        if self._cp[0] > 1:
            cfg = self.config
            unsupported = [name for name, on in (
                ("rotary_interleaved", cfg.rotary_interleaved),
                ("flash_decode", cfg.flash_decode),
                (f"num_query_groups={cfg.num_query_groups} < tensor-parallel size {self.world_size}",
                 cfg.num_query_groups < self.world_size),
            ) if on]
            if unsupported:
                from loongforge.core.config import ConfigError

                raise ConfigError(f"parallel.cp={self._cp[0]}: context parallelism in the fast layer does not "
                                  f"support {', '.join(unsupported)}")

    def _own_path(self, key_value_states, inference_context, kwargs) -> bool:
        cfg = self.config
        return (
            key_value_states is None
            and inference_context is None
            and kwargs.get("inference_params") is None
            and kwargs.get("rotary_pos_cos") is None
            and not cfg.rotary_interleaved
            and not cfg.flash_decode
            and cfg.num_query_groups >= self.world_size
        )

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, **kwargs):
        if not self._own_path(key_value_states, inference_context, kwargs):
            if self._cp[0] > 1:
                raise ValueError(f"FusedSelfAttention: context_parallel_size={self._cp[0]} trains only (no "
                                 "inference, cross attention or precomputed rotary cos/sin)")
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, **kwargs)
        packed = kwargs.get("packed_seq_params")
        thd = packed is not None and packed.qkv_format == "thd"
        chunk = self.chunk_state
        if chunk is not None:
            if thd or self._cp[0] > 1:
                raise ValueError("FusedSelfAttention: ChunkPipe runs unpacked sequences without context parallelism")
            rotary_pos_emb = chunk.angles  # this chunk's rows of the whole sequence's angles
        qkv, _ = self.linear_qkv(hidden_states)  # [s, b, groups * (heads_per_group [* 2 gated] + 2) * d]
        s, b = qkv.shape[:2]
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        gate = None
        if self.config.attention_output_gate:  # per group: query heads, their gates, key, value
            qkv = qkv.view(s, b, groups, 2 * per_group + 2, d)
            gate = qkv[..., per_group : 2 * per_group, :]
            qkv = torch.cat([qkv[..., :per_group, :], qkv[..., 2 * per_group :, :]], dim=3)
        else:
            qkv = qkv.view(s, b, groups, per_group + 2, d)
        q_emb = k_emb = None
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
            cu = layout = None
            if thd:
                cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
                layout = forward_layout(packed, cu)
            options = dict(mscale=self._yarn_concentration_factor, cp=self._cp,
                           per_token=self.config.mrope_section is not None, layout=layout)
        one_pass = q_emb is not None and q_emb is k_emb
        if one_pass and self.q_layernorm is None and self.k_layernorm is None:
            # one pass over the qkv row: split, rotate, lay out (and one pass back in the backward)
            query, key, value = self._grouped_qkv_rope(qkv, *self.rope_tables.get(q_emb, (s, b), cu, **options))
        elif one_pass and self._norms_in_qkv_pass:  # the same pass with the per-head norms
            query, key, value = self._grouped_qkv_norm_rope(
                qkv, *self.rope_tables.get(q_emb, (s, b), cu, **options), self.q_layernorm.weight,
                self.k_layernorm.weight, self.q_layernorm.eps)
        else:
            query, key = qkv[..., :per_group, :], qkv[..., per_group : per_group + 1, :]
            value = qkv[..., per_group + 1 :, :]
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            if self.k_layernorm is not None:
                key = self.k_layernorm(key)
            if q_emb is not None:
                query = self._rope(query, *self.rope_tables.get(q_emb, (s, b, groups), cu, **options))
                key = self._rope(key, *self.rope_tables.get(k_emb, (s, b, groups), cu, **options))
            query = query.reshape(s, b, groups * per_group, d)
            key = key.reshape(s, b, groups, d)
            value = value.reshape(s, b, groups, d).contiguous()  # a copy: frees the qkv output
        if thd:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        if chunk is not None:
            key, value = chunk.keys_values(self, key, value)  # the earlier chunks' and this one's

        attn_args = dict(attn_mask_type=self.attn_mask_type, attention_bias=kwargs.get("attention_bias"),
                         packed_seq_params=packed)
        if self.checkpoint_core_attention and self.training:
            context = self._checkpointed_attention_forward(query, key, value, attention_mask, **attn_args)
        else:
            context = self.core_attention(query, key, value, attention_mask, **attn_args)
        if thd:
            context = context.reshape(context.shape[0], 1, -1)
        if gate is not None:  # megatron's output gate: context * sigmoid(gate), in fp32
            context = (context * torch.sigmoid(gate.reshape(context.shape).float())).to(context.dtype)
        return self.linear_proj(context)


def share_rope_tables(model: torch.nn.Module) -> None:
    """Gives every ``FusedSelfAttention`` layer of ``model`` the same new ``RopeTables``: the
    model's, built by its first layer in each forward and reused by the others."""
    tables = RopeTables()
    for module in model.modules():
        if isinstance(module, FusedSelfAttention):
            module.rope_tables = tables
