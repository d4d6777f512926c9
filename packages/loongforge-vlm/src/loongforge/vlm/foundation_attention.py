"""Which self-attention a VLM's foundation layers attend through: loongforge-llm's
``FusedSelfAttention`` (the fast layer, which takes per-token multimodal RoPE angles, THD rows and
the VLM's context-parallel split) or another; and whether its layers take packed rows only (a
hybrid foundation's Gated DeltaNet layers: ``cu_seqlens``, no attention mask)."""

from __future__ import annotations

from loongforge.llm.api import GPTConfig


def _mixers(foundation: GPTConfig) -> tuple[type, ...]:
    """The module classes of the foundation layers' ``self_attention`` slots (loongforge-llm's
    ``token_mixers``); none where the family has no megatron layers."""
    from loongforge.llm.api import token_mixers

    try:
        return tuple(m for m in token_mixers(foundation) if isinstance(m, type))
    except ValueError:  # a family without a megatron layer spec
        return ()


def foundation_attention(foundation: GPTConfig):
    """The self-attention module the foundation's (attention) layers are built with (a class; None
    where the family has no layer spec or the spec has no self-attention slot)."""
    from megatron.core.transformer.attention import Attention

    return next((m for m in _mixers(foundation) if issubclass(m, Attention)), None)


def on_fast_layer(foundation: GPTConfig) -> bool:
    """Whether the foundation's layers attend through loongforge-llm's ``FusedSelfAttention`` (per-token
    multimodal RoPE angles, THD rows, context parallelism)."""
    from loongforge.llm.api import FusedSelfAttention

    attention = foundation_attention(foundation)
    return isinstance(attention, type) and issubclass(attention, FusedSelfAttention)


def takes_packed_rows_only(foundation: GPTConfig) -> bool:
    """Whether some of the foundation's layers mix tokens without attention (Gated DeltaNet), so
    take a packed row by its ``cu_seqlens`` and refuse a dense attention mask."""
    from megatron.core.transformer.attention import Attention

    return any(not issubclass(m, Attention) for m in _mixers(foundation))
