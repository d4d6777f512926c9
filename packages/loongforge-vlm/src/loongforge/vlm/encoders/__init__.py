"""Vision encoders on megatron-core. Each family is one module (its config class, its
``VisionEncoder`` and its ``ComponentSpec``) registered under ``loongforge.components``:
``qwen2_5_vit`` (Qwen2.5-VL's ViT), ``qwen3_vit`` (Qwen3-VL's), ``siglip_vit`` (SigLIP), ``internvit``
(InternVL's InternViT)."""

from __future__ import annotations


def build_encoder(cfg, config, pg_collection):
    """The encoder of ``cfg.family`` (a registered ``vision_encoder`` component)."""
    from loongforge.core.models import get_component

    return get_component(cfg.family, "vision_encoder").build(cfg, config, pg_collection)
