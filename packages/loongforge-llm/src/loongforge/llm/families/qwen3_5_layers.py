"""The decoder blocks of the Qwen3.5 families: megatron layer specs, per layer.

A layer is either gated full attention or Gated DeltaNet (``LinearAttentionFields.is_linear_layer``).
The dense family starts from the fast layer (``layers.spec.fast_layer_spec``: fused norms, SDPA
core attention); the MoE family from its megatron local block (``families.moe.block_spec``). In
both, every RMSNorm outside the DeltaNet (the layer norms, q/k norms, the final norm) is the
zero-centred one Qwen3.5 stores (``ZeroCenteredRMSNorm``), the full layers' attention carries the
output gate (``attention_output_gate`` in the transformer config, megatron's ``SelfAttention``
path) and the linear layers' ``self_attention`` slot holds ``GatedDeltaNet``.
"""

from __future__ import annotations

import dataclasses
import functools

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.qwen3_5_config import LinearAttentionFields

# the local spec saves the input norm under linear_qkv's name; a DeltaNet layer has no linear_qkv
_LINEAR_LAYER_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def delta_net_spec(cfg: LinearAttentionFields, kernels: KernelPolicy):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge.llm.layers.gated_delta_net import GatedDeltaNet

    return ModuleSpec(module=GatedDeltaNet, params=dict(
        num_key_heads=cfg.linear_num_key_heads, num_value_heads=cfg.linear_num_value_heads,
        key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim, kernels=kernels))


def _zero_centred_norms(spec, norm):
    """``spec`` (a TransformerLayer spec) with its layer norms and its attention's q/k norms ``norm``."""
    sub = spec.submodules
    attention = sub.self_attention
    attention_sub = dataclasses.replace(attention.submodules, q_layernorm=norm, k_layernorm=norm)
    attention = dataclasses.replace(attention, submodules=attention_sub)
    changes = {"self_attention": attention, "pre_mlp_layernorm": norm}
    from megatron.core.transformer.identity_op import IdentityOp

    if sub.input_layernorm is not IdentityOp:
        changes["input_layernorm"] = norm
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))


def _as_linear_layer(spec, cfg: LinearAttentionFields, kernels: KernelPolicy, norm):
    sub = dataclasses.replace(spec.submodules, self_attention=delta_net_spec(cfg, kernels), input_layernorm=norm,
                              sharded_state_dict_keys_map=_LINEAR_LAYER_KEYS)
    return dataclasses.replace(spec, submodules=sub)


def local_layer_ids(config) -> range:
    """The global indices of this pipeline stage's layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    return range(offset, offset + get_num_layers_to_build(config))


def hybrid_block(cfg: LinearAttentionFields, layer_specs: list, layer_ids, kernels: KernelPolicy):
    """The block of ``layer_specs`` (one per id of ``layer_ids``: full-attention specs), the
    DeltaNet layers swapped in and every norm zero-centred."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from loongforge.llm.layers.norm import ZeroCenteredRMSNorm

    norm = functools.partial(ZeroCenteredRMSNorm, kernels=kernels)
    specs = []
    for layer, spec in zip(layer_ids, layer_specs, strict=True):
        spec = _zero_centred_norms(spec, norm)
        specs.append(_as_linear_layer(spec, cfg, kernels, norm) if cfg.is_linear_layer(layer) else spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def dense_block(cfg, config, kernels: KernelPolicy):
    """This pipeline stage's block of the dense family, on the fast layer."""
    from loongforge.llm.layers.spec import fast_layer_spec

    ids = local_layer_ids(config)
    return hybrid_block(cfg, [fast_layer_spec(cfg, kernels=kernels)] * len(ids), ids, kernels)


def moe_block(cfg, config, kernels: KernelPolicy):
    """This pipeline stage's block of the MoE family, on the MoE families' local layers."""
    from loongforge.llm.families.moe import block_spec

    block = block_spec(cfg, config, kernels)
    return hybrid_block(cfg, list(block.layer_specs), local_layer_ids(config), kernels)
