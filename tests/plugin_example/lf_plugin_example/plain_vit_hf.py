"""The Hugging Face layout of a ``plain_vit`` composition (``PlainViTForConditionalGeneration``):
the plugin's encoder, the shipped ``mlp`` projector and any loongforge-llm foundation, registered
under ``loongforge.vlm.hf_layouts`` so that the stock ``lf-vlm convert`` reads and writes it.

The checkpoint is SigLIP-style names for the vision tower (``vision_tower.*``, a ``Conv2d`` patch
embedding, ``q; k; v`` stacked in one ``qkv``), ``multi_modal_projector.linear_{1,2}`` for the
projector and the foundation's own layout under ``language_model.``; ``config.json`` carries the
three parts' configs and the vision token settings.
"""

from __future__ import annotations

from dataclasses import asdict

from loongforge.core.hf_mapping import HFMapping, Rule
from loongforge.core.models import get_component, get_model_spec
from loongforge.llm.api import GPT_HF_MAPPING
from loongforge.vlm.hf_layout import Layout

ARCHITECTURE = "PlainViTForConditionalGeneration"

_BLOCK, _LAYER = "encoder.layers.{layer}.", "decoder.layers.{layer}."

VISION_MAPPING = HFMapping(
    rules=(
        *(Rule(f"embeddings.patch_embedding.{p}", f"patch_embed.{p}",
               *(("vit_conv2d_patch_embedding",) if p == "weight" else ())) for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"layer_norm1.{p}", _LAYER + f"self_attention.linear_qkv.layer_norm_{p}")
          for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"self_attn.qkv.{p}", _LAYER + f"self_attention.linear_qkv.{p}", "vit_fused_qkv")
          for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"self_attn.out_proj.{p}", _LAYER + f"self_attention.linear_proj.{p}") for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"layer_norm2.{p}", _LAYER + f"mlp.linear_fc1.layer_norm_{p}") for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"mlp.fc{n}.{p}", _LAYER + f"mlp.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
        *(Rule(f"post_layernorm.{p}", f"decoder.final_layernorm.{p}") for p in ("weight", "bias")),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
)

PROJECTOR_MAPPING = HFMapping(
    rules=tuple(Rule(f"linear_{n}.{p}", f"mlp.encoder.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
)


def bind(cfg):
    """The whole checkpoint's mapping for a ``VLMModelConfig`` of this layout."""
    return (VISION_MAPPING.bind(cfg.encoder).prefixed(hf="vision_tower.", lf="encoder.")
            + PROJECTOR_MAPPING.bind(cfg.projector).prefixed(hf="multi_modal_projector.", lf="projector.")
            + GPT_HF_MAPPING.bind(cfg.foundation).prefixed(hf="language_model.", lf="language_model."))


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> this layout's ``config.json``."""
    foundation = cfg.foundation
    text = get_model_spec(foundation.family).hf_adapter.config_to_hf(foundation)
    return {"architectures": [ARCHITECTURE], "model_type": "plain_vit_vlm", "foundation_family": foundation.family,
            "vision_config": asdict(cfg.encoder), "projector_config": asdict(cfg.projector),
            "vision_tokens": asdict(cfg.vision), "text_config": text}


def config_from_hf(raw: dict):
    """This layout's ``config.json`` -> ``VLMModelConfig``."""
    from loongforge.vlm.model import VLMModelConfig
    from loongforge.vlm.model_config import VisionTokensConfig

    from lf_plugin_example.plain_vit import PlainViTConfig

    projector = dict(raw["projector_config"])
    projector_class = get_component(projector["family"], "projector").config_class
    foundation = get_model_spec(raw["foundation_family"]).hf_adapter.config_from_hf(raw["text_config"])
    return VLMModelConfig(encoder=PlainViTConfig(**raw["vision_config"]), projector=projector_class(**projector),
                          foundation=foundation, vision=VisionTokensConfig(**raw["vision_tokens"]))


PLAIN_VIT_LAYOUT = Layout("plain_vit", ARCHITECTURE, "plain_vit", None, bind, config_from_hf, config_to_hf)
