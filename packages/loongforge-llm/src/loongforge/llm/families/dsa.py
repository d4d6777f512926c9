"""DeepSeek sparse attention (DeepSeek-V3.2) layers from megatron-core's own modules, local backend.

megatron's DSA layer is ``AbsorbedMLASelfAttention`` (MLA in MQA form) whose core attention is
``DSAttention`` with its lightning indexer ``DSAIndexer``; its spec functions
(``experimental_attention_variant_module_specs``) take a ``BackendSpecProvider`` and ship only
Transformer Engine's. megatron's ``LocalSpecProvider`` lacks two things they use, which
``LocalDSASpecProvider`` adds:

- ``linear()``, the unsharded projection the indexer builds with ``parallel_mode="duplicated"``:
  megatron's local ``Linear`` (``post_training.modelopt.layers``; plain ``torch.nn.Linear`` with
  megatron's parameter attributes);
- norms usable under sequence parallelism (``norm``), for the layers, the latents and the
  indexer's key LayerNorm.

Without Transformer Engine, ``AbsorbedMLASelfAttention`` accepts its down projections only as
column-parallel linears (gathered over TP afterwards), as in megatron's local MLA spec, so the
attention spec takes those in place of ``linear()``. megatron's MLA does not sum the key's gradient
over TP on that path (its rope part: each TP rank's heads give only their share), so the core
attention sums it (``RegistryDSAttention._key_summed_over_tp``).

The core attention is ``RegistryDSAttention``: megatron's ``DSAttention`` whose indexer top-k,
indexer loss and sparse attention are the kernel registry's ops (loongforge-kernels' Triton
kernels where they run, the torch references of ``loongforge.llm.ops.dsa`` elsewhere, as the
build's ``KernelPolicy`` picks them), instead of megatron's torch path, which builds every
head's full ``[sq, skv]`` scores for the attention and for the loss.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.experimental_attention_variant import dsa as megatron_dsa
from megatron.core.transformer.experimental_attention_variant.dsa_layout import get_packed_qk_cu_seqlens
from megatron.core.utils import get_pg_size

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.families.core_attention import tail_grad_summed_over_tp
from loongforge.llm.families.norm import LayerNorm, RMSNorm
from loongforge.llm.families.dsa_context_parallel import query_pieces, real_query_rows
from loongforge.llm.layers.context_parallel_attention import GatheredLayout, gather_in_order
from loongforge.llm.layers.packed_params import forward_layout
from loongforge.llm.ops.dsa import indexer_scores


class RegistryDSAttention(megatron_dsa.DSAttention):
    """megatron's DSAttention with the indexer top-k, the indexer loss and the sparse MLA
    attention from the kernel registry.

    The indexer (its q/k/weights from detached inputs), the loss attachment
    (``DSAIndexerLossAutoScaler``) and logging are megatron's. The registry's ops take the same
    quantities: ``dsa_indexer_topk`` scores ``sum_h w_h relu(q_h . k)`` with megatron's
    weights (which carry its scales) over the causal keys; ``dsa_indexer_loss`` is megatron's KL
    from the head-summed, L1-normalised main attention to the indexer's softmax, per query
    (summed under per-token loss, else averaged, times ``dsa_indexer_loss_coeff``); the
    attention gets MLA's absorbed form, one latent row per key (``[kv_lora_rank | rope]``, the
    first part also the value), and the value up-projection follows. The attention runs before
    the loss and hands the sparse loss its log-sum-exp, so that the loss's target takes one pass
    over the logits (on one TP rank; the dense warm-up loss recomputes its own). Under TP the heads are
    split and the loss's target needs megatron's all-reduce: there the loss is megatron's
    ``compute_dsa_indexer_loss`` on the same top-k (so every layout selects the same keys); the
    indexer is duplicated over TP (all its heads on every rank), so the top-k is the same there.
    Packed (THD) rows run as one batch row, each packed sequence against its own keys only. Under
    context parallelism (with any TP) the whole sequences' (or packed row's) latent rows and
    indexer keys are all-gathered and each local query chunk runs against its causal key prefix
    (``dsa_context_parallel``). Layouts the registry ops do not cover (an explicit mask, top-k
    shared across layers) run megatron's forward.
    ``kernels``: the policy the registry ops are resolved by when the module is built.
    """

    def __init__(self, *args, kernels: KernelPolicy = KernelPolicy(), column_parallel_kv_down: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._indexer_topk, self._indexer_loss = kernels.get("dsa_indexer_topk"), kernels.get("dsa_indexer_loss")
        self._sparse_attention = kernels.get("sparse_mla_attention")
        self._column_parallel_kv_down = column_parallel_kv_down

    def _key_summed_over_tp(self, key):
        """``key`` whose gradient is summed over TP where megatron's MLA does not sum it.

        With a column-parallel ``linear_kv_down_proj`` (``attention_spec``), megatron's
        ``AbsorbedMLASelfAttention`` all-gathers the down projection's output over TP
        (``gather_from_tensor_model_parallel_region``, whose backward only splits) and each TP
        rank's heads then give only their share of the key's gradient. The latent part is summed
        by the sequence-parallel gather that follows its norm (reduce-scatter backward); the rope
        part (and, without sequence parallelism, the latent part too) is not, so every TP rank's
        down projection would learn from its own heads only. ``copy_to_tensor_model_parallel_region``
        (identity forward, all-reduce backward) sums it."""
        if not self._column_parallel_kv_down:
            return key
        return tail_grad_summed_over_tp(key, self.config.kv_lora_rank if self.config.sequence_parallel else 0,
                                        self.pg_collection.tp)

    def _registry_path(self, query, key, value, attention_mask, up_v_weight, packed_seq_params) -> bool:
        packed = packed_seq_params is not None
        return (value is None and up_v_weight is not None and key.size(-2) == 1 and attention_mask is None
                and (not packed or packed_seq_params.qkv_format == "thd") and not self.index_share
                and self.config.dsa_indexer_scoring_relu
                and query.size(0) == key.size(0))  # this rank's rows (sequence parallel: gathered by the MLA)

    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, up_v_weight=None):
        key = self._key_summed_over_tp(key)
        if not self._registry_path(query, key, value, attention_mask, up_v_weight, packed_seq_params):
            return super().forward(query, key, value, attention_mask, x, qr, position_ids=position_ids,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params, up_v_weight=up_v_weight)
        cp_group = self.pg_collection.cp
        cp_size = get_pg_size(cp_group)
        cp_rank = cp_group.rank() if cp_size > 1 else 0
        real = bounds = None
        layout = GatheredLayout()  # dense; a packed row's is its forward's, shared by every layer
        if packed_seq_params is not None:  # THD: [t, heads, dim] as one batch row [t, 1, heads, dim]
            query, key = query.unsqueeze(1), key.unsqueeze(1)
            cu, _ = get_packed_qk_cu_seqlens(packed_seq_params)
            layout = forward_layout(packed_seq_params, cu)
            bounds = layout.bounds()
            if packed_seq_params.cu_seqlens_q_padded is not None:  # CP's padding after each sequence
                real = layout.cached(("real query rows", cp_size, cp_rank, query.device), lambda: real_query_rows(
                    packed_seq_params.cu_seqlens_q, cu, cp_size, cp_rank).to(query.device)[None])
        sq, b, heads, _ = query.shape
        config = self.config
        coeff = config.dsa_indexer_loss_coeff or 0.0
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        with torch.enable_grad() if with_loss else torch.no_grad():
            q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
            if cp_size > 1:  # every key of the sequences, natural order (dsa_context_parallel)
                k = gather_in_order(k, cp_group, layout)
        kv = key[:, :, 0] if cp_size == 1 else gather_in_order(key[:, :, 0], cp_group, layout)
        # the registry ops' batch-major layouts: [b, s, heads, dim], one latent KV row per key
        q_attn, kv_attn = query.transpose(0, 1), kv.transpose(0, 1)
        q_idx, k_idx, w_idx = q.transpose(0, 1), k.transpose(0, 1), weights.transpose(0, 1)
        pieces = query_pieces(sq, cp_size, cp_rank, bounds)
        topk = torch.cat([self._indexer_topk(q_idx[:, t0:t1].detach(), k_idx[:, k0:k1].detach(),
                                             w_idx[:, t0:t1].detach(), self.index_topk)
                          for t0, t1, k0, k1 in pieces], 1)
        # the attention runs before the loss (the two are independent), so that the registry's sparse
        # loss can take its log-sum-exp: one pass over the logits for the loss's target instead of two
        with_lse = with_loss and config.dsa_indexer_use_sparse_loss and get_pg_size(self.pg_collection.tp) == 1
        attended = [self._sparse_attention(q_attn[:, t0:t1], kv_attn[:, k0:k1], topk[:, t0:t1], self.softmax_scale,
                                           config.kv_lora_rank, return_lse=with_lse)
                    for t0, t1, k0, k1 in pieces]
        lse = torch.cat([piece_lse for _, piece_lse in attended], 1) if with_lse else None
        latent = torch.cat([out for out, _ in attended] if with_lse else attended, 1)
        loss = None
        if with_loss:
            loss = self._indexer_loss_of_pieces(pieces, q_idx, k_idx, w_idx, topk, query, kv, real, lse)
        output = torch.einsum("bshc,hdc->sbhd", latent, up_v_weight.to(latent.dtype)).reshape(sq, b, -1)
        if loss is None:
            return output
        # logged like megatron's: summed (per-token loss) or averaged over the CP group
        groups = {"reduce_group" if config.calculate_per_token_loss else "avg_group": cp_group} if cp_size > 1 else {}
        megatron_dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, config.num_layers,
                                                                      **groups)
        return megatron_dsa.DSAIndexerLossAutoScaler.apply(output, loss)

    def _indexer_loss_of_pieces(self, pieces, q_idx, k_idx, w_idx, topk, query, kv, real, lse):
        """``dsa_indexer_loss_coeff`` times the indexer's KL loss of this rank's real queries
        (``real``: ``[1, sq]`` bool, None for all), summed (per-token loss) or averaged. One TP
        rank holds every head: the registry's ``dsa_indexer_loss`` per piece, with the sparse
        attention's log-sum-exp ``lse`` ``[b, sq, heads]`` where given (the sparse loss); under TP,
        ``_tensor_parallel_indexer_loss``."""
        config = self.config
        if get_pg_size(self.pg_collection.tp) == 1:
            q_attn, kv_attn = query.transpose(0, 1).detach(), kv.transpose(0, 1).detach()
            sparse = config.dsa_indexer_use_sparse_loss
            per_query = torch.cat([self._indexer_loss(q_idx[:, t0:t1], k_idx[:, k0:k1], w_idx[:, t0:t1],
                                                      q_attn[:, t0:t1], kv_attn[:, k0:k1], self.softmax_scale,
                                                      topk[:, t0:t1] if sparse else None,
                                                      None if lse is None else lse[:, t0:t1])
                                   for t0, t1, k0, k1 in pieces], 1)
            total = (per_query if real is None else per_query * real).sum()
        else:
            total = self._tensor_parallel_indexer_loss(pieces, q_idx, k_idx, w_idx, topk, query, kv, real)
        if not config.calculate_per_token_loss:
            total = total / (real.sum().clamp_min(1) if real is not None else query.shape[0] * query.shape[1])
        return (config.dsa_indexer_loss_coeff or 0.0) * total

    def _tensor_parallel_indexer_loss(self, pieces, q_idx, k_idx, w_idx, topk, query, kv, real):
        """The indexer's KL loss summed over the real queries, when each TP rank holds some of the
        heads and the loss's target needs megatron's all-reduce: megatron's
        ``compute_dsa_indexer_loss`` per piece (each piece's keys causal to its queries) on the
        registry's top-k; every TP rank of a CP rank runs the same pieces, so the same collectives."""
        heads, total = query.shape[2], 0.0
        for t0, t1, k0, k1 in pieces:
            c, n = t1 - t0, k1 - k0
            causal = torch.full((c, n), float("-inf"), device=query.device).triu(n - c + 1)
            total = total + megatron_dsa.compute_dsa_indexer_loss(
                indexer_scores(q_idx[:, t0:t1], k_idx[:, k0:k1], w_idx[:, t0:t1]), topk[:, t0:t1].long(),
                query[t0:t1].detach(), kv[k0:k1, :, None].detach().expand(-1, -1, heads, -1), self.softmax_scale,
                1.0, self.config.dsa_indexer_use_sparse_loss, self.pg_collection, mask=causal,
                query_valid_rows=None if real is None else real[:, t0:t1], calculate_per_token_loss=True)
        return total


class LocalDSASpecProvider(LocalSpecProvider):
    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        return RMSNorm if rms_norm else LayerNorm


def attention_spec(config, kernels: KernelPolicy = KernelPolicy()):
    """megatron's DSA self-attention spec (AbsorbedMLA + DSAttention + DSAIndexer), local backend;
    ``kernels``: the policy of the core attention's registry ops."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    spec = get_dsa_module_spec_for_backend(config, backend=LocalDSASpecProvider())
    core = spec.submodules.core_attention
    core = dataclasses.replace(core, module=RegistryDSAttention,
                               params={**core.params, "kernels": kernels, "column_parallel_kv_down": True})
    changes = dict(linear_q_down_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear, core_attention=core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def layer_specs(config, kernels: KernelPolicy = KernelPolicy()) -> list:
    """Every decoder layer's spec (dense/MoE MLP by ``config.moe_layer_freq``), DSA attention in all."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )

    attention = attention_spec(config, kernels)
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=LocalDSASpecProvider())
    return [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=attention)) for s in layers]


def block_spec(config, kernels: KernelPolicy = KernelPolicy()):
    """This pipeline stage's DSA decoder layers and the final RMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    stage = layer_specs(config, kernels)[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=stage, layer_norm=RMSNorm)
