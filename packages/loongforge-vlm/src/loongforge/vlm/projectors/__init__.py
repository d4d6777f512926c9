"""Projectors (vision features -> foundation embeddings). Each family is one module (its config
class and its ``ComponentSpec``; the module is ``base.Projector``) registered under
``loongforge.components``: ``patch_merge_mlp`` (Qwen2.5-VL's merger), ``mlp`` (LLaVA's),
``internvl_pixel_shuffle_mlp`` (InternVL's)."""

from __future__ import annotations


def build_projector(cfg, encoder, foundation_hidden: int, foundation_config, pg_collection):
    """The projector of ``cfg.family`` (a registered ``projector`` component)."""
    from loongforge.core.models import get_component

    return get_component(cfg.family, "projector").build(cfg, encoder, foundation_hidden, foundation_config,
                                                        pg_collection)
