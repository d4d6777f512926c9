"""The Hugging Face layout of an InternVL composition (``InternVLForConditionalGeneration``, the
``-HF`` checkpoints of InternVL3/3.5): ``internvit`` + ``internvl_pixel_shuffle_mlp`` + a ``qwen3``
foundation with 1-D RoPE.

Three declarative tables, each bound to its own config: the vision tower (``vision_tower.*`` <->
``encoder.*``: separate q/k/v projections fused per head, the ``Conv2d`` patch embedding as a
linear map of flattened patches, layer scale ``lambda_1``/``lambda_2`` on the branches' output
linears), the projector (``multi_modal_projector.*`` <-> ``projector.*``) and the language model:
loongforge-llm's ``GPT_HF_MAPPING`` under ``language_model.`` (the names transformers saves). A
tensor no table names is an error naming it, in both directions.
"""

from __future__ import annotations

from loongforge.core.hf_mapping import FuseQKV, HFMapping, MappingError, Rule, register_transform
from loongforge.vlm import hf_config_parts as parts
from loongforge.vlm.hf_layout import Layout

ARCHITECTURE = "InternVLForConditionalGeneration"
NORM_TYPES = {"layer_norm": "layernorm", "rms_norm": "rmsnorm"}
PROJECTOR_EPS = 1e-5  # transformers' projector LayerNorm keeps nn.LayerNorm's default
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # InternVL's preprocessor_config.json


register_transform("vit_separate_qkv", FuseQKV(heads="num_attention_heads", groups="num_attention_heads",
                                               head_dim="head_dim"))

_BLOCK, _LAYER = "encoder.layer.{layer}.", "decoder.layers.{layer}."
_QKV = tuple(_BLOCK + f"attention.{x}_proj." for x in "qkv")


def _layernorm(cfg) -> bool:
    return cfg.norm == "layernorm"


INTERNVIT_MAPPING = HFMapping(
    rules=(
        Rule("embeddings.cls_token", "cls_token"),
        Rule("embeddings.position_embeddings", "position_embedding"),
        Rule("embeddings.patch_embeddings.projection.weight", "patch_embed.weight", "vit_conv2d_patch_embedding"),
        Rule("embeddings.patch_embeddings.projection.bias", "patch_embed.bias"),
        Rule(_BLOCK + "layernorm_before.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        Rule(_BLOCK + "layernorm_before.bias", _LAYER + "self_attention.linear_qkv.layer_norm_bias", when=_layernorm),
        Rule(tuple(p + "weight" for p in _QKV), _LAYER + "self_attention.linear_qkv.weight", "vit_separate_qkv"),
        Rule(tuple(p + "bias" for p in _QKV), _LAYER + "self_attention.linear_qkv.bias", "vit_separate_qkv",
             when="qkv_bias"),
        Rule(_BLOCK + "attention.q_norm.weight", _LAYER + "self_attention.q_layernorm.weight", when="qk_norm"),
        Rule(_BLOCK + "attention.k_norm.weight", _LAYER + "self_attention.k_layernorm.weight", when="qk_norm"),
        *(Rule(_BLOCK + f"attention.projection_layer.{p}", _LAYER + f"self_attention.linear_proj.{p}")
          for p in ("weight", "bias")),
        Rule(_BLOCK + "lambda_1", _LAYER + "self_attention.linear_proj.layer_scale"),
        Rule(_BLOCK + "layernorm_after.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
        Rule(_BLOCK + "layernorm_after.bias", _LAYER + "mlp.linear_fc1.layer_norm_bias", when=_layernorm),
        *(Rule(_BLOCK + f"mlp.fc{n}.{p}", _LAYER + f"mlp.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
        Rule(_BLOCK + "lambda_2", _LAYER + "mlp.linear_fc2.layer_scale"),
        *(Rule(f"layernorm.{p}", f"decoder.final_layernorm.{p}", when="post_norm") for p in ("weight", "bias")),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
)

PROJECTOR_MAPPING = HFMapping(
    rules=(
        *(Rule(f"layer_norm.{p}", f"norm.{p}") for p in ("weight", "bias")),
        *(Rule(f"linear_{n}.{p}", f"mlp.encoder.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
    ),
)


def bind(cfg):
    """The whole checkpoint's mapping for a ``VLMModelConfig`` of this layout."""
    from loongforge.llm.api import GPT_HF_MAPPING

    return (INTERNVIT_MAPPING.bind(cfg.encoder).prefixed(hf="vision_tower.", lf="encoder.")
            + PROJECTOR_MAPPING.bind(cfg.projector).prefixed(hf="multi_modal_projector.", lf="projector.")
            + GPT_HF_MAPPING.bind(cfg.foundation).prefixed(hf="language_model.", lf="language_model."))


# checkpoint name prefixes -> module paths of transformers' InternVLForConditionalGeneration (which saves the older
# llava-style layout)
MODULE_PREFIXES = (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
                   ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))


def module_name(hf_name: str) -> str | None:
    """The module path of an InternVL checkpoint name, or None for a name of another layout."""
    for saved, module in MODULE_PREFIXES:
        if hf_name.startswith(saved):
            return module + hf_name.removeprefix(saved)
    return None


def _square(value, key: str) -> int:
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1]:
        raise MappingError(f"config.json of {ARCHITECTURE}: vision_config.{key}={value!r}: only square sizes are supported")
    return int(sides[0])


def config_from_hf(raw: dict):
    """``config.json`` of InternVL -> ``VLMModelConfig`` (a qwen3 foundation, 1-D RoPE)."""
    from transformers import InternVLConfig

    from loongforge.vlm.encoders.internvit import InternViTConfig
    from loongforge.vlm.model import VLMModelConfig
    from loongforge.vlm.model_config import VisionTokensConfig
    from loongforge.vlm.projectors.pixel_shuffle_mlp import PixelShuffleMLPConfig

    hf = InternVLConfig.from_dict(raw)
    v, t = hf.vision_config, hf.text_config
    source = f"config.json of {ARCHITECTURE}"
    fixed = {"text_config.model_type": (t.model_type, "qwen3"), "vision_config.hidden_act": (v.hidden_act, "gelu"),
             "projector_hidden_act": (hf.projector_hidden_act, "gelu"), "downsample_ratio": (hf.downsample_ratio, 0.5),
             "vision_feature_layer": (hf.vision_feature_layer, -1),
             "vision_feature_select_strategy": (hf.vision_feature_select_strategy, "default"),
             "vision_config.use_absolute_position_embeddings": (v.use_absolute_position_embeddings, True),
             "vision_config.use_mask_token": (v.use_mask_token, False)}
    for key, (value, needed) in fixed.items():
        if value != needed:
            raise MappingError(f"{source}: {key}={value!r}: LoongForge's InternVL supports {needed!r}")
    if v.norm_type not in NORM_TYPES:
        raise MappingError(f"{source}: vision_config.norm_type={v.norm_type!r}: one of {', '.join(NORM_TYPES)}")
    foundation, _ = parts.foundation_from_hf("qwen3", hf, t.to_dict())
    encoder = InternViTConfig(
        num_layers=v.num_hidden_layers, hidden_size=v.hidden_size, num_attention_heads=v.num_attention_heads,
        ffn_hidden_size=v.intermediate_size, in_channels=v.num_channels, patch_size=_square(v.patch_size, "patch_size"),
        image_size=_square(v.image_size, "image_size"), norm=NORM_TYPES[v.norm_type], qkv_bias=bool(v.attention_bias),
        qk_norm=bool(v.use_qk_norm), layer_scale_init=float(v.layer_scale_init_value),
        post_norm=not v.use_mean_pooling, norm_epsilon=float(v.layer_norm_eps),
        init_method_std=float(v.initializer_range),
    )
    projector = PixelShuffleMLPConfig(norm_epsilon=PROJECTOR_EPS)
    # InternVL marks video frames with the image's <IMG_CONTEXT> token too
    vision = VisionTokensConfig(rope="rope", image_token_id=hf.image_token_id, video_token_id=hf.image_token_id)
    return VLMModelConfig(encoder=encoder, projector=projector, foundation=foundation, vision=vision)


def train_data(cfg) -> dict:
    """The ``data`` settings a converted InternVL trains with: its tiles, ImageNet normalisation
    and ``<img><IMG_CONTEXT>...</img>`` placeholders."""
    return {"media": {"tile_size": cfg.encoder.image_size, "min_tiles": 1, "max_tiles": 12, "placeholders": "internvl",
                      "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}}


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> InternVL ``config.json``; a composition InternVL cannot express is an error."""
    from transformers import InternVLConfig

    e, p, f, vis = cfg.encoder, cfg.projector, cfg.foundation, cfg.vision
    parts.require({"projector.family": (p.family, "internvl_pixel_shuffle_mlp"),
                   "projector.ffn_hidden_size": (p.ffn_hidden_size or f.hidden_size, f.hidden_size),
                   "projector.norm_epsilon": (p.norm_epsilon, PROJECTOR_EPS),
                   "encoder.spatial_merge_size": (e.spatial_merge_size, 2), "vision.rope": (vis.rope, "rope"),
                   "foundation.family": (f.family, "qwen3")}, ARCHITECTURE)
    text = {**parts.text_config_to_hf("qwen3", f, {}), "model_type": "qwen3"}  # InternVL's default text model is qwen2
    norm_type = {v: k for k, v in NORM_TYPES.items()}[e.norm]
    vision = dict(hidden_size=e.hidden_size, num_hidden_layers=e.num_layers, num_attention_heads=e.num_attention_heads,
                  intermediate_size=e.ffn_hidden_size, num_channels=e.in_channels, patch_size=[e.patch_size] * 2,
                  image_size=[e.image_size] * 2, norm_type=norm_type, attention_bias=e.qkv_bias,
                  use_qk_norm=e.qk_norm, layer_scale_init_value=e.layer_scale_init, use_mean_pooling=not e.post_norm,
                  layer_norm_eps=e.norm_epsilon, hidden_act="gelu", initializer_range=e.init_method_std)
    ids = {"image_token_id": vis.image_token_id} if vis.image_token_id is not None else {}
    tokens = (e.image_size // e.patch_size // e.spatial_merge_size) ** 2
    hf = InternVLConfig(text_config=text, vision_config=vision, tie_word_embeddings=f.tie_embeddings,
                        image_seq_length=tokens, architectures=[ARCHITECTURE], **ids)
    return hf.to_dict()


LAYOUT = Layout("internvl", ARCHITECTURE, "internvit", ("qwen3",), bind, config_from_hf, config_to_hf, train_data)
