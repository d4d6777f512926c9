"""Which self-attention a VLM's foundation layers attend through: loongforge-llm's
``FusedSelfAttention`` (the fast layer, which takes per-token multimodal RoPE angles, THD rows and
the VLM's context-parallel split) or another."""

from __future__ import annotations

from loongforge.llm.api import GPTConfig


def foundation_attention(foundation: GPTConfig):
    """The self-attention module the foundation's layer spec builds (a class; None where the family
    has no layer spec or the spec has no self-attention slot)."""
    from loongforge.core.models import get_model_spec

    layer_spec = get_model_spec(foundation.family).layer_spec
    if layer_spec is None:
        return None
    spec = layer_spec(foundation)
    return getattr(getattr(getattr(spec, "submodules", None), "self_attention", None), "module", None)


def on_fast_layer(foundation: GPTConfig) -> bool:
    """Whether the foundation's layers attend through loongforge-llm's ``FusedSelfAttention`` (per-token
    multimodal RoPE angles, THD rows, context parallelism)."""
    from loongforge.llm.api import FusedSelfAttention

    attention = foundation_attention(foundation)
    return isinstance(attention, type) and issubclass(attention, FusedSelfAttention)
