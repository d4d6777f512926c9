"""The layer spec of the Transformer-Engine-free path (``families.gpt.layer_spec`` picks it).

It keeps megatron's local spec's modules for the linears (tensor parallel as megatron does it),
its parameter names and its sharded-state-dict key map, so checkpoints and the HF mapping are the
same whichever spec trained them.
"""

from __future__ import annotations

import dataclasses
import functools


def _local_spec(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")


def _with_attention(spec, module=None, **submodules):
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, module=module or attention.module, submodules=dataclasses.replace(attention.submodules, **submodules)
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def fast_layer_spec(cfg, recompute_elementwise: bool = True):
    """The fast decoder layer: ``FusedTransformerLayer`` (fused residual add + RMSNorm, no no-op
    dropout, norm/SwiGLU outputs recomputed in the backward when ``recompute_elementwise``),
    ``FusedSelfAttention`` (fused RoPE read from the qkv projection) on ``SDPAttention``,
    ``FusedRMSNorm`` norms (also q/k norms) and ``FusedMLP`` (fused SwiGLU), each op from the
    ``loongforge.core.kernels`` registry."""
    from loongforge.llm.layers.attention import SDPAttention
    from loongforge.llm.layers.mlp import FusedMLP
    from loongforge.llm.layers.norm import FusedRMSNorm
    from loongforge.llm.layers.self_attention import FusedSelfAttention
    from loongforge.llm.layers.transformer_layer import FusedTransformerLayer

    spec = _local_spec(cfg)
    qk_norm = {"q_layernorm": FusedRMSNorm, "k_layernorm": FusedRMSNorm} if cfg.qk_layernorm else {}
    spec = _with_attention(spec, FusedSelfAttention, core_attention=SDPAttention, **qk_norm)
    mlp = spec.submodules.mlp
    if not isinstance(mlp, functools.partial):
        raise TypeError(f"fast_layer_spec: megatron's local MLP spec is {mlp!r}; expected MLP.as_mlp_submodule")
    mlp = functools.partial(FusedMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    submodules = dataclasses.replace(spec.submodules, input_layernorm=FusedRMSNorm, pre_mlp_layernorm=FusedRMSNorm, mlp=mlp)
    return dataclasses.replace(spec, module=FusedTransformerLayer, submodules=submodules,
                               params={**spec.params, "recompute_elementwise": recompute_elementwise})
