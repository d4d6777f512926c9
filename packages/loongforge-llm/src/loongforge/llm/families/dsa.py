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
attention spec takes those in place of ``linear()``. The attention itself runs megatron's torch
path (``dsa_kernel_backend: none``), on CPU as on GPUs.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.backends import LocalSpecProvider

from loongforge.llm.families.norm import LayerNorm, RMSNorm


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
    down = dict(linear_q_down_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **down))


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
