"""The decoder of a family as another package builds it into a model of its own (a VLM's foundation
``GPTModel``): the layer spec megatron's ``GPTModel`` takes, and the token-mixer modules its
layers hold.

A family with one kind of layer gives its one-layer spec (``ModelSpec.layer_spec``); a hybrid
family (Qwen3.5: Gated DeltaNet and gated full-attention layers, ``LinearAttentionFields``) gives
the block of this pipeline stage's per-layer specs, as its own builder does.
"""

from __future__ import annotations

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.model_config import GPTConfig
from loongforge.llm.moe_config import MoEConfig
from loongforge.llm.qwen3_5_config import LinearAttentionFields


def _layer_spec(cfg: GPTConfig):
    from loongforge.core.models import get_model_spec

    spec = get_model_spec(cfg.family)
    if spec.layer_spec is None:
        raise ValueError(f"family={cfg.family!r} has no megatron layer spec (not a GPT-style family)")
    return spec.layer_spec(cfg)


def decoder_spec(cfg: GPTConfig, transformer_config, kernels: KernelPolicy = KernelPolicy()):
    """``transformer_layer_spec`` of megatron's ``GPTModel`` for ``cfg`` on this pipeline stage
    (``transformer_config``'s): the family's one-layer spec, or a hybrid family's block."""
    if isinstance(cfg, LinearAttentionFields):
        from loongforge.llm.families.qwen3_5_layers import dense_block, moe_block

        block = moe_block if isinstance(cfg, MoEConfig) else dense_block
        return block(cfg, transformer_config, kernels)
    return _layer_spec(cfg)


def _attention_layer_spec(cfg: GPTConfig):
    """The spec of the family's attention layers (a hybrid family's full-attention ones)."""
    if not isinstance(cfg, LinearAttentionFields):
        return _layer_spec(cfg)
    if isinstance(cfg, MoEConfig):
        from loongforge.llm.families.moe import layer_spec

        return layer_spec(cfg)
    from loongforge.llm.layers.spec import fast_layer_spec

    return fast_layer_spec(cfg)


def token_mixers(cfg: GPTConfig) -> tuple[type, ...]:
    """The module classes in the ``self_attention`` slot of the family's layers, one per kind of
    layer: the attention (megatron's ``SelfAttention`` or a subclass), and for a hybrid family
    also ``GatedDeltaNet``, which takes packed rows by ``cu_seqlens`` and no attention mask."""
    attention = _attention_layer_spec(cfg).submodules.self_attention.module
    if not isinstance(cfg, LinearAttentionFields):
        return (attention,)
    from loongforge.llm.layers.gated_delta_net import GatedDeltaNet

    return (attention, GatedDeltaNet)
