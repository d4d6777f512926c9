"""The Hugging Face layout of a Qwen3-VL composition (``Qwen3VLForConditionalGeneration``):
``qwen3_vit`` + ``patch_merge_mlp`` (LayerNorm) + DeepStack mergers + a ``qwen3`` foundation with
interleaved multimodal RoPE.

Four declarative tables, each bound to its own config: the vision transformer
(``model.visual.*`` <-> ``encoder.*``, its fused ``qkv`` and ``Conv3d`` patch embedding through
the Qwen2.5-VL transforms of ``loongforge.vlm.hf``), its patch merger (``model.visual.merger.*``
<-> ``projector.*``), the DeepStack mergers (``model.visual.deepstack_merger_list.{i}.*`` <->
``deepstack.{i}.*``) and the language model: loongforge-llm's ``GPT_HF_MAPPING`` with its
``model.`` names nested under ``model.language_model.``. A tensor no table names is an error
naming it, in both directions.
"""

from __future__ import annotations

from loongforge.core.hf_mapping import HFMapping, Rule
from loongforge.vlm import hf_config_parts as parts
from loongforge.vlm.hf_layout import Layout

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
EPS = 1e-6  # transformers' Qwen3-VL hard-codes the epsilon of its vision norms

_BLOCK, _LAYER = "blocks.{layer}.", "decoder.layers.{layer}."

QWEN3_VIT_MAPPING = HFMapping(
    rules=(
        Rule("patch_embed.proj.weight", "patch_embed.weight", "vit_patch_embedding"),
        Rule("patch_embed.proj.bias", "patch_embed.bias"),
        Rule("pos_embed.weight", "position_embedding"),
        *(Rule(_BLOCK + f"norm1.{p}", _LAYER + f"self_attention.linear_qkv.layer_norm_{p}") for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"attn.qkv.{p}", _LAYER + f"self_attention.linear_qkv.{p}", "vit_fused_qkv")
          for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"attn.proj.{p}", _LAYER + f"self_attention.linear_proj.{p}") for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"norm2.{p}", _LAYER + f"mlp.linear_fc1.layer_norm_{p}") for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"mlp.linear_fc{n}.{p}", _LAYER + f"mlp.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
)

MERGER_MAPPING = HFMapping(
    rules=(
        *(Rule(f"norm.{p}", f"norm.{p}") for p in ("weight", "bias")),
        *(Rule(f"linear_fc{n}.{p}", f"mlp.encoder.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
    ),
)


def vision_mapping(cfg):
    """The vision tower's part of the checkpoint (ViT, merger, DeepStack mergers), bound."""
    out = (QWEN3_VIT_MAPPING.bind(cfg.encoder).prefixed(hf="model.visual.", lf="encoder.")
           + MERGER_MAPPING.bind(cfg.projector).prefixed(hf="model.visual.merger.", lf="projector."))
    for i in range(len(cfg.encoder.deepstack_layers)):
        out = out + MERGER_MAPPING.bind(cfg.projector).prefixed(hf=f"model.visual.deepstack_merger_list.{i}.",
                                                                lf=f"deepstack.{i}.")
    return out


def bind(cfg):
    """The whole checkpoint's mapping for a ``VLMModelConfig`` of this layout."""
    from loongforge.llm.api import GPT_HF_MAPPING

    foundation = GPT_HF_MAPPING.bind(cfg.foundation).hf_prefix_replaced("model.", "model.language_model.")
    return vision_mapping(cfg) + foundation.prefixed(lf="language_model.")


def composition(v, hf, foundation, section, deepstack_layers: list[int]):
    """The ``VLMModelConfig`` of a Qwen3-VL(-MoE) or Qwen3.5 checkpoint: its ``vision_config`` ``v``
    and token ids (``hf``), the converted foundation, the mrope section and the DeepStack layers."""
    from loongforge.vlm.encoders.qwen3_vit import Qwen3ViTConfig
    from loongforge.vlm.model import VLMModelConfig
    from loongforge.vlm.model_config import VisionTokensConfig
    from loongforge.vlm.projectors.patch_merge_mlp import PatchMergeMLPConfig

    vision_rope = dict(getattr(v, "rope_parameters", None) or {})
    encoder = Qwen3ViTConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, num_attention_heads=v.num_heads,
        ffn_hidden_size=v.intermediate_size, in_channels=v.in_channels, patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
        num_position_embeddings=v.num_position_embeddings, deepstack_layers=list(deepstack_layers),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)), norm_epsilon=EPS,
        init_method_std=float(v.initializer_range),
    )
    projector = PatchMergeMLPConfig(norm="layernorm", norm_epsilon=EPS)
    vision = VisionTokensConfig(rope="mrope_interleaved", mrope_section=section, **parts.token_ids_from_hf(hf))
    return VLMModelConfig(encoder=encoder, projector=projector, foundation=foundation, vision=vision)


def config_from_hf(raw: dict):
    """``config.json`` of Qwen3-VL -> ``VLMModelConfig`` (a qwen3 foundation, interleaved mrope)."""
    from transformers import Qwen3VLConfig

    hf = Qwen3VLConfig.from_dict(raw)
    v, t = parts.checked_parts(hf, f"config.json of {ARCHITECTURE}", "gelu_pytorch_tanh", "Qwen3 ViT")
    foundation, section = parts.foundation_from_hf("qwen3", hf, t.to_dict())  # transformers' Qwen3-VL always interleaves
    return composition(v, hf, foundation, section, v.deepstack_visual_indexes)


def vision_to_hf(cfg, architecture: str = ARCHITECTURE) -> tuple[dict, dict]:
    """``(vision_config, token ids)`` of a Qwen3-VL(-MoE) ``config.json``, after checking the
    vision side of the composition."""
    e, p, vis = cfg.encoder, cfg.projector, cfg.vision
    merged = e.hidden_size * e.spatial_merge_size ** 2
    parts.require({"projector.family": (p.family, "patch_merge_mlp"),
                   "projector.norm": (getattr(p, "norm", None), "layernorm"),
                   "projector.merged_norm": (getattr(p, "merged_norm", None), False),
                   "projector.ffn_hidden_size": (p.ffn_hidden_size or merged, merged),
                   "projector.norm_epsilon": (p.norm_epsilon, EPS), "encoder.norm_epsilon": (e.norm_epsilon, EPS),
                   "vision.rope": (vis.rope, "mrope_interleaved")}, architecture)
    vision = dict(depth=e.num_layers, hidden_size=e.hidden_size, num_heads=e.num_attention_heads,
                  intermediate_size=e.ffn_hidden_size, in_channels=e.in_channels, patch_size=e.patch_size,
                  temporal_patch_size=e.temporal_patch_size, spatial_merge_size=e.spatial_merge_size,
                  num_position_embeddings=e.num_position_embeddings, deepstack_visual_indexes=list(e.deepstack_layers),
                  out_hidden_size=cfg.foundation.hidden_size, hidden_act="gelu_pytorch_tanh",
                  initializer_range=e.init_method_std, rope_parameters={"rope_type": "axial", "rope_theta": e.rope_theta})
    return vision, parts.token_ids_to_hf(vis)


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> Qwen3-VL ``config.json``; a composition Qwen3-VL cannot express is an error."""
    from transformers import Qwen3VLConfig

    f = cfg.foundation
    vision, ids = vision_to_hf(cfg)
    parts.require({"foundation.family": (f.family, "qwen3")}, ARCHITECTURE)
    text = parts.text_config_to_hf("qwen3", f, {"mrope_section": cfg.mrope_section, "mrope_interleaved": True})
    hf = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=f.tie_embeddings,
                       architectures=[ARCHITECTURE], **ids)
    return hf.to_dict()


LAYOUT = Layout("qwen3_vl", ARCHITECTURE, "qwen3_vit", ("qwen3",), bind, config_from_hf, config_to_hf)
