"""Layer specs of the Transformer-Engine-free path (``families.gpt.layer_spec`` picks one)."""

from __future__ import annotations

import dataclasses


def sdpa_local_layer_spec(cfg):
    """megatron's local decoder layer (``get_gpt_layer_local_spec``) with ``SDPAttention`` as its
    core attention: same modules and parameter names, attention without the ``[s, s]`` scores."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from loongforge.llm.layers.attention import SDPAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
