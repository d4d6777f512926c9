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
attention spec takes those in place of ``linear()``.

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
from megatron.core.transformer.experimental_attention_variant.dsa_masking import build_dsattention_forward_mask
from megatron.core.utils import get_pg_size

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.families.norm import LayerNorm, RMSNorm
from loongforge.llm.families.dsa_context_parallel import gather_sequence, query_chunks
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
    first part also the value), and the value up-projection follows. Under TP the heads are
    split and the loss's target needs megatron's all-reduce: there the loss is megatron's
    ``compute_dsa_indexer_loss`` on the same top-k (so every layout selects the same keys).
    Under context parallelism (with TP 1) the whole sequences' latent rows and indexer keys are
    all-gathered and each local query chunk runs against its causal key prefix
    (``dsa_context_parallel``). Layouts the registry ops do not cover (an explicit mask, packed
    sequences, context parallel with TP, top-k shared across layers) run megatron's forward.
    ``kernels``: the policy the registry ops are resolved by when the module is built.
    """

    def __init__(self, *args, kernels: KernelPolicy = KernelPolicy(), **kwargs):
        super().__init__(*args, **kwargs)
        self._indexer_topk, self._indexer_loss = kernels.get("dsa_indexer_topk"), kernels.get("dsa_indexer_loss")
        self._sparse_attention = kernels.get("sparse_mla_attention")

    def _registry_path(self, query, key, value, attention_mask, up_v_weight, packed_seq_params) -> bool:
        one_of_tp_cp = get_pg_size(self.pg_collection.cp) == 1 or get_pg_size(self.pg_collection.tp) == 1
        return (value is None and up_v_weight is not None and key.size(2) == 1 and attention_mask is None
                and packed_seq_params is None and not self.index_share and one_of_tp_cp
                and self.config.dsa_indexer_scoring_relu
                and query.size(0) == key.size(0))  # this rank's rows (sequence parallel: gathered by the MLA)

    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, up_v_weight=None):
        if not self._registry_path(query, key, value, attention_mask, up_v_weight, packed_seq_params):
            return super().forward(query, key, value, attention_mask, x, qr, position_ids=position_ids,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params, up_v_weight=up_v_weight)
        sq, b, heads, _ = query.shape
        config = self.config
        coeff = config.dsa_indexer_loss_coeff or 0.0
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        cp_group = self.pg_collection.cp
        cp_size = get_pg_size(cp_group)
        with torch.enable_grad() if with_loss else torch.no_grad():
            q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), None)
            if cp_size > 1:  # every key of the sequences, natural order (dsa_context_parallel)
                k = gather_sequence(k, cp_group)
        kv = key[:, :, 0] if cp_size == 1 else gather_sequence(key[:, :, 0], cp_group)
        # the registry ops' batch-major layouts: [b, s, heads, dim], one latent KV row per key
        q_attn, kv_attn = query.transpose(0, 1), kv.transpose(0, 1)
        q_idx, k_idx, w_idx = q.transpose(0, 1), k.transpose(0, 1), weights.transpose(0, 1)
        chunks = query_chunks(sq, cp_size, cp_group.rank() if cp_size > 1 else 0)
        topk = torch.cat([self._indexer_topk(q_idx[:, t0:t1].detach(), k_idx[:, :n].detach(),
                                             w_idx[:, t0:t1].detach(), self.index_topk) for t0, t1, n in chunks], 1)
        loss = None
        if with_loss and get_pg_size(self.pg_collection.tp) > 1:  # one process of the CP group
            loss = self._tensor_parallel_indexer_loss(q_idx, k_idx, w_idx, topk, query, key, attn_mask_type, position_ids)
        elif with_loss:
            sparse = config.dsa_indexer_use_sparse_loss
            per_query = torch.cat([self._indexer_loss(q_idx[:, t0:t1], k_idx[:, :n], w_idx[:, t0:t1],
                                                      q_attn[:, t0:t1].detach(), kv_attn[:, :n].detach(),
                                                      self.softmax_scale, topk[:, t0:t1] if sparse else None)
                                   for t0, t1, n in chunks], 1)
            loss = coeff * (per_query.sum() if config.calculate_per_token_loss else per_query.mean())
        latent = torch.cat([self._sparse_attention(q_attn[:, t0:t1], kv_attn[:, :n], topk[:, t0:t1],
                                                   self.softmax_scale, config.kv_lora_rank)
                            for t0, t1, n in chunks], 1)
        output = torch.einsum("bshc,hdc->sbhd", latent, up_v_weight.to(latent.dtype)).reshape(sq, b, -1)
        if loss is None:
            return output
        # logged like megatron's: summed (per-token loss) or averaged over the CP group
        groups = {"reduce_group" if config.calculate_per_token_loss else "avg_group": cp_group} if cp_size > 1 else {}
        megatron_dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, config.num_layers,
                                                                      **groups)
        return megatron_dsa.DSAIndexerLossAutoScaler.apply(output, loss)

    def _tensor_parallel_indexer_loss(self, q_idx, k_idx, w_idx, topk, query, key, attn_mask_type, position_ids):
        """megatron's indexer loss (``compute_dsa_indexer_loss``) on the registry's top-k: each TP
        rank holds some of the heads, and megatron all-reduces their attention target."""
        config = self.config
        sq, b, heads, _ = query.shape
        mask, bounds, _ = build_dsattention_forward_mask(
            sq=sq, skv=key.size(0), b=b, device=query.device, cp_size=1, cp_rank=0, cp_comm_type=self.cp_comm_type,
            cp_group=self.pg_collection.cp, attn_mask_type=attn_mask_type, attention_mask=None,
            position_ids=position_ids, packed_seq_params=None)
        starts, ends, positions = bounds if bounds is not None else (None, None, None)
        return megatron_dsa.compute_dsa_indexer_loss(
            indexer_scores(q_idx, k_idx, w_idx), topk.long(), query.detach(), key.detach().expand(-1, -1, heads, -1),
            self.softmax_scale, config.dsa_indexer_loss_coeff, config.dsa_indexer_use_sparse_loss, self.pg_collection,
            mask=mask, varlen_starts=starts, varlen_ends=ends, key_positions=positions,
            calculate_per_token_loss=config.calculate_per_token_loss)


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
    core = dataclasses.replace(core, module=RegistryDSAttention, params={**core.params, "kernels": kernels})
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
