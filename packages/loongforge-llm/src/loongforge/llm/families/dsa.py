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

The core attention is ``RegistryDSAttention``: megatron's ``DSAttention`` (its indexer, top-k,
masks and indexer loss) whose sparse attention over the selected keys is the kernel registry's
``sparse_mla_attention`` (loongforge-kernels' Triton kernel where it runs, the torch reference
elsewhere), instead of megatron's torch path, which builds every head's full ``[sq, skv]``
scores. Layouts that path does not cover (packed sequences, context parallel, top-k shared
across layers) run megatron's own forward.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.experimental_attention_variant import dsa as megatron_dsa
from megatron.core.transformer.experimental_attention_variant.dsa_masking import build_dsattention_forward_mask
from megatron.core.utils import get_pg_size

from loongforge.core.kernels.registry import get_kernel
from loongforge.llm.families.norm import LayerNorm, RMSNorm


class RegistryDSAttention(megatron_dsa.DSAttention):
    """megatron's DSAttention with the sparse MLA attention from the kernel registry.

    The indexer's q/k/weights, the causal bounds, the top-k (and, training, megatron's indexer
    loss with its top-k, logged and attached by ``DSAIndexerLossAutoScaler``) are megatron's, as
    in its reference path; only the attention over the selected latent rows changes. MLA's
    absorbed form hands it one latent KV row per key (``[kv_lora_rank | rope]``, the first part
    also the value), which is the kernel's contract; the value up-projection follows.
    """

    def _registry_path(self, query, key, value, up_v_weight, packed_seq_params) -> bool:
        return (value is None and up_v_weight is not None and key.size(2) == 1 and packed_seq_params is None
                and not self.index_share and get_pg_size(self.pg_collection.cp) == 1
                and query.size(0) == key.size(0))  # full sequence (sequence parallel: gathered by the MLA)

    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, up_v_weight=None):
        if not self._registry_path(query, key, value, up_v_weight, packed_seq_params):
            return super().forward(query, key, value, attention_mask, x, qr, position_ids=position_ids,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params, up_v_weight=up_v_weight)
        sq, b, heads, _ = query.shape
        config = self.config
        mask, bounds, _ = build_dsattention_forward_mask(
            sq=sq, skv=key.size(0), b=b, device=query.device, cp_size=1, cp_rank=0, cp_comm_type=self.cp_comm_type,
            cp_group=self.pg_collection.cp, attn_mask_type=attn_mask_type, attention_mask=attention_mask,
            position_ids=position_ids, packed_seq_params=None)
        starts, ends, positions = bounds if bounds is not None else (None, None, None)
        coeff = config.dsa_indexer_loss_coeff or 0.0
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        with torch.enable_grad() if with_loss else torch.no_grad():  # the indexer sees detached inputs
            q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), None)
        if with_loss:
            topk, loss = megatron_dsa.FusedDSAIndexerLoss.apply(
                q, weights, k, query.detach(), key.detach().expand(-1, -1, heads, -1), self.softmax_scale,
                self.index_topk, coeff, mask, config.dsa_indexer_use_sparse_loss, self.pg_collection, starts, ends,
                positions, None, config.calculate_per_token_loss, config.dsa_indexer_scoring_relu)
            megatron_dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, config.num_layers)
        else:
            with torch.no_grad():
                _, topk = megatron_dsa.fused_qk_topk_naive(q, k, weights, self.index_topk, mask=mask, varlen_starts=starts,
                                                           varlen_ends=ends, key_positions=positions,
                                                           use_relu=config.dsa_indexer_scoring_relu)
        # [sq, b, heads, latent + rope] / [skv, b, 1, latent + rope] -> the kernel's batch-major layout
        latent = get_kernel("sparse_mla_attention")(query.transpose(0, 1), key[:, :, 0].transpose(0, 1), topk,
                                                    self.softmax_scale, config.kv_lora_rank)
        output = torch.einsum("bshc,hdc->sbhd", latent, up_v_weight.to(latent.dtype)).reshape(sq, b, -1)
        return megatron_dsa.DSAIndexerLossAutoScaler.apply(output, loss) if with_loss else output


class LocalDSASpecProvider(LocalSpecProvider):
    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        return RMSNorm if rms_norm else LayerNorm


def attention_spec(config):
    """megatron's DSA self-attention spec (AbsorbedMLA + DSAttention + DSAIndexer), local backend."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    spec = get_dsa_module_spec_for_backend(config, backend=LocalDSASpecProvider())
    core = dataclasses.replace(spec.submodules.core_attention, module=RegistryDSAttention)
    changes = dict(linear_q_down_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear, core_attention=core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def layer_specs(config) -> list:
    """Every decoder layer's spec (dense/MoE MLP by ``config.moe_layer_freq``), DSA attention in all."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )

    attention = attention_spec(config)
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=LocalDSASpecProvider())
    return [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=attention)) for s in layers]


def block_spec(config):
    """This pipeline stage's DSA decoder layers and the final RMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    stage = layer_specs(config)[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=stage, layer_norm=RMSNorm)
