"""The Hugging Face layouts of the Qwen3.5 compositions (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): ``qwen3_vit`` without DeepStack + ``patch_merge_mlp``
(LayerNorm) + a ``qwen3_5`` / ``qwen3_5_moe`` foundation (Gated DeltaNet and gated attention
layers) with interleaved multimodal RoPE on the rotated quarter of each attention head.

transformers' ``Qwen3_5VisionModel`` is Qwen3-VL's vision model without the DeepStack mergers
(same patch embedding, learned position grid, 2-D RoPE, blocks and patch merger), so the vision
tables are Qwen3-VL's (``hf_qwen3_vl.vision_mapping``, which binds no DeepStack merger for an
encoder without DeepStack layers). The language model is the foundation family's own table
(loongforge-llm's Qwen3.5 adapters, through the model registry) with its ``model.`` names under
``model.language_model.``; the checkpoints' multi-token-prediction tensors (``mtp.*``) are not
built and are ignored on import. A tensor no table names is an error naming it, in both
directions. The MoE checkpoints store each expert's ``gate_proj``/``up_proj``/``down_proj``
(transformers fuses them in memory and writes them back per expert), which is the MoE family's
table as it is.
"""

from __future__ import annotations

from loongforge.vlm import hf_config_parts as parts
from loongforge.vlm import hf_qwen3_vl as qwen3_vl
from loongforge.vlm.hf_layout import Layout

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MOE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
# transformers' Qwen3.5 text rotary embedding uses this section when rope_parameters has none
DEFAULT_MROPE_SECTION = [11, 11, 10]


def _foundation_adapter(family: str):
    from loongforge.core.models import get_model_spec

    return get_model_spec(family).hf_adapter


def bind(cfg):
    """The whole checkpoint's mapping for a ``VLMModelConfig`` of either layout."""
    foundation = _foundation_adapter(cfg.foundation.family).bind(cfg.foundation)
    foundation = foundation.hf_prefix_replaced("model.", "model.language_model.")
    return qwen3_vl.vision_mapping(cfg) + foundation.prefixed(lf="language_model.")


def _config_from_hf(raw: dict, architecture: str, config_class: str, family: str):
    import transformers

    hf = getattr(transformers, config_class).from_dict(raw)
    v, t = parts.checked_parts(hf, f"config.json of {architecture}", "gelu_pytorch_tanh", "Qwen3 ViT")
    foundation, section = parts.foundation_from_hf(family, hf, t.to_dict())  # transformers always interleaves
    return qwen3_vl.composition(v, hf, foundation, section or DEFAULT_MROPE_SECTION, deepstack_layers=[])


def config_from_hf(raw: dict):
    """``config.json`` of Qwen3.5 -> ``VLMModelConfig`` (a qwen3_5 foundation, interleaved mrope)."""
    return _config_from_hf(raw, ARCHITECTURE, "Qwen3_5Config", "qwen3_5")


def moe_config_from_hf(raw: dict):
    """``config.json`` of Qwen3.5-MoE -> ``VLMModelConfig`` (a qwen3_5_moe foundation, interleaved mrope)."""
    return _config_from_hf(raw, MOE_ARCHITECTURE, "Qwen3_5MoeConfig", "qwen3_5_moe")


def _config_to_hf(cfg, architecture: str, config_class: str, family: str) -> dict:
    import transformers

    f = cfg.foundation
    parts.require({"foundation.family": (f.family, family),
                   "encoder.deepstack_layers": (list(cfg.encoder.deepstack_indices()), [])}, architecture)
    vision, ids = qwen3_vl.vision_to_hf(cfg, architecture)
    del vision["deepstack_visual_indexes"]  # Qwen3.5's vision config has no DeepStack
    text = parts.text_config_to_hf(family, f, {"mrope_section": cfg.mrope_section, "mrope_interleaved": True})
    hf = getattr(transformers, config_class)(text_config=text, vision_config=vision, tie_word_embeddings=f.tie_embeddings,
                                             architectures=[architecture], **ids)
    return hf.to_dict()


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> Qwen3.5 ``config.json``; a composition it cannot express is an error."""
    return _config_to_hf(cfg, ARCHITECTURE, "Qwen3_5Config", "qwen3_5")


def moe_config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> Qwen3.5-MoE ``config.json``; a composition it cannot express is an error
    (the foundation's routing and dense layers are checked by its family's adapter)."""
    return _config_to_hf(cfg, MOE_ARCHITECTURE, "Qwen3_5MoeConfig", "qwen3_5_moe")


LAYOUT = Layout("qwen3_5_vl", ARCHITECTURE, "qwen3_vit", ("qwen3_5",), bind, config_from_hf, config_to_hf)
MOE_LAYOUT = Layout("qwen3_5_vl_moe", MOE_ARCHITECTURE, "qwen3_vit", ("qwen3_5_moe",), bind, moe_config_from_hf,
                    moe_config_to_hf)
