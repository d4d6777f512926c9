"""The Hugging Face layouts of the ``vlm`` family: one per HF architecture, each its own mapping
tables and ``config.json`` translation, registered under ``loongforge.vlm.hf_layouts``
(``hf_layout.Layout``; ``layouts()`` reads them all, shipped and installed by other packages);
the family's adapter reads the layout of a checkpoint's ``architectures`` and writes the one of a
model's encoder and foundation families. Qwen2.5-VL's (``Qwen2_5_VLForConditionalGeneration``) is
here; Qwen3-VL's is ``hf_qwen3_vl``, Qwen3-VL-MoE's ``hf_qwen3_vl_moe``, Qwen3.5's (dense and MoE)
``hf_qwen3_5_vl``, InternVL's ``hf_internvl``.

The checkpoint is three parts, each a declarative table of the core mapping engine bound to its
own config and prefixed: the vision transformer (``visual.*`` <-> ``encoder.*``), its patch
merger (``visual.merger.*`` <-> ``projector.*``) and the language model, whose layout is
loongforge-llm's ``GPT_HF_MAPPING`` (``model.*``/``lm_head`` <-> ``language_model.*``).

Two transforms are the ViT's own: its fused ``qkv`` projection (q, k, v of all heads stacked)
<-> megatron's per-head interleaved ``linear_qkv``, and the ``Conv3d`` patch embedding <-> the
linear map of flattened patches (a reshape).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points

import torch

from loongforge.core.hf_mapping import FuseQKV, HFAdapter, HFMapping, MappingError, Rule, Transform, register_transform
from loongforge.core.hf_mapping.transforms import config_value
from loongforge.core.models import load_specs
from loongforge.vlm import hf_config_parts as parts
from loongforge.vlm.encoders.qwen2_5_vit import QwenViTConfig
from loongforge.vlm.hf_layout import LAYOUT_GROUP, Layout
from loongforge.vlm.model_config import VisionTokensConfig
from loongforge.vlm.projectors.patch_merge_mlp import PatchMergeMLPConfig

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


class FusedQKV(Transform):
    """HF ``[q; k; v]`` (all heads of each, stacked) <-> megatron's per-head ``[q_h, k_h, v_h]``."""

    n_hf, n_lf = 1, 1
    splits_rows = True  # a row permutation: a LoRA B of linear_qkv becomes qkv's
    per_head = FuseQKV(heads="num_attention_heads", groups="num_attention_heads", head_dim="head_dim")

    def to_lf(self, tensors, ctx):
        (qkv,) = tensors
        if qkv.shape[0] % 3:
            raise MappingError(f"{ctx.hf[0]}: shape {list(qkv.shape)} does not split into q, k, v")
        return self.per_head.to_lf(list(qkv.chunk(3, dim=0)), ctx)

    def to_hf(self, tensors, ctx):
        return [torch.cat(self.per_head.to_hf(tensors, ctx), dim=0)]


class PatchEmbedding(Transform):
    """A convolution's weight ``[hidden, *kernel]`` <-> a linear weight ``[hidden, prod(kernel)]``
    (stride = kernel); ``kernel``: the config keys of the kernel's dims after the output channels
    (``Conv3d``: ``C, T, p, p``; ``Conv2d``: ``C, p, p``)."""

    n_hf, n_lf = 1, 1

    def __init__(self, kernel: tuple[str, ...] = ("in_channels", "temporal_patch_size", "patch_size", "patch_size")):
        self.kernel = kernel

    def to_lf(self, tensors, ctx):
        (w,) = tensors
        return [w.reshape(w.shape[0], -1).clone()]

    def to_hf(self, tensors, ctx):
        (w,) = tensors
        return [w.reshape(w.shape[0], *(int(config_value(ctx.cfg, k)) for k in self.kernel)).clone()]


register_transform("vit_fused_qkv", FusedQKV())
register_transform("vit_patch_embedding", PatchEmbedding())  # Qwen2.5-VL / Qwen3-VL: Conv3d
register_transform("vit_conv2d_patch_embedding", PatchEmbedding(kernel=("in_channels", "patch_size", "patch_size")))  # InternViT

_BLOCK, _LAYER = "blocks.{layer}.", "decoder.layers.{layer}."

QWEN_VIT_MAPPING = HFMapping(
    rules=(
        Rule("patch_embed.proj.weight", "patch_embed.weight", "vit_patch_embedding"),
        Rule(_BLOCK + "norm1.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        Rule(_BLOCK + "attn.qkv.weight", _LAYER + "self_attention.linear_qkv.weight", "vit_fused_qkv"),
        Rule(_BLOCK + "attn.qkv.bias", _LAYER + "self_attention.linear_qkv.bias", "vit_fused_qkv"),
        Rule(_BLOCK + "attn.proj.weight", _LAYER + "self_attention.linear_proj.weight"),
        Rule(_BLOCK + "attn.proj.bias", _LAYER + "self_attention.linear_proj.bias"),
        Rule(_BLOCK + "norm2.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
        *(Rule((_BLOCK + f"mlp.gate_proj.{p}", _BLOCK + f"mlp.up_proj.{p}"), _LAYER + f"mlp.linear_fc1.{p}", "fuse_gate_up")
          for p in ("weight", "bias")),
        *(Rule(_BLOCK + f"mlp.down_proj.{p}", _LAYER + f"mlp.linear_fc2.{p}") for p in ("weight", "bias")),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
)

PATCH_MERGER_MAPPING = HFMapping(
    rules=(
        Rule("ln_q.weight", "norm.weight"),
        *(Rule(f"mlp.{i}.{p}", f"mlp.encoder.linear_fc{n}.{p}") for i, n in ((0, 1), (2, 2)) for p in ("weight", "bias")),
    ),
)


def module_name(hf_name: str) -> str:
    """The module path in transformers' ``Qwen2_5_VLForConditionalGeneration`` of a checkpoint
    name, which keeps the older layout (``visual.*`` is ``model.visual.*``, ``model.*`` of the
    language model is ``model.language_model.*``; ``lm_head`` is itself; Qwen3-VL's checkpoints
    already use the module layout); InternVL's names
    (``vision_tower.*``, ``language_model.model.*`` ...) as ``hf_internvl.module_name`` says."""
    from loongforge.vlm.hf_internvl import module_name as internvl_module_name

    internvl = internvl_module_name(hf_name)
    if internvl is not None:
        return internvl
    if hf_name.startswith(("model.visual.", "model.language_model.")):  # Qwen3-VL: already the module layout
        return hf_name
    if hf_name.startswith("visual."):
        return "model." + hf_name
    if hf_name.startswith("model."):
        return "model.language_model." + hf_name.removeprefix("model.")
    return hf_name


def foundation_mapping():
    from loongforge.llm.api import GPT_HF_MAPPING

    return GPT_HF_MAPPING


def qwen2_5_bind(cfg):
    """The whole checkpoint's mapping: each part's table bound to its own config."""
    return (QWEN_VIT_MAPPING.bind(cfg.encoder).prefixed(hf="visual.", lf="encoder.")
            + PATCH_MERGER_MAPPING.bind(cfg.projector).prefixed(hf="visual.merger.", lf="projector.")
            + foundation_mapping().bind(cfg.foundation).prefixed(lf="language_model."))


def qwen2_5_config_from_hf(raw: dict):
    """``config.json`` of Qwen2.5-VL -> ``VLMModelConfig`` (a qwen2 foundation with mrope)."""
    from transformers import Qwen2_5_VLConfig

    from loongforge.vlm.model import VLMModelConfig

    hf = Qwen2_5_VLConfig.from_dict(raw)
    v, t = parts.checked_parts(hf, f"config.json of {ARCHITECTURE}", "silu", "Qwen2.5 ViT")
    foundation, section = parts.foundation_from_hf("qwen2", hf, t.to_dict())
    vision_rope = dict(getattr(v, "rope_parameters", None) or {})
    encoder = QwenViTConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, num_attention_heads=v.num_heads,
        ffn_hidden_size=v.intermediate_size, in_channels=v.in_channels, patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size, window_size=v.window_size,
        full_attention_layers=list(v.fullatt_block_indexes), rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        norm_epsilon=1e-6, init_method_std=float(v.initializer_range),
    )
    projector = PatchMergeMLPConfig(norm="rmsnorm", norm_epsilon=1e-6)
    vision = VisionTokensConfig(rope="mrope", mrope_section=section, tokens_per_second=float(v.tokens_per_second),
                                **parts.token_ids_from_hf(hf))
    return VLMModelConfig(encoder=encoder, projector=projector, foundation=foundation, vision=vision)


def qwen2_5_config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> Qwen2.5-VL ``config.json``; a composition Qwen2.5-VL cannot express is an error."""
    from transformers import Qwen2_5_VLConfig

    e, p, vis = cfg.encoder, cfg.projector, cfg.vision
    merged = e.hidden_size * e.spatial_merge_size ** 2
    parts.require({"encoder.family": (e.family, "qwen2_5_vit"), "projector.family": (p.family, "patch_merge_mlp"),
                   "projector.norm": (getattr(p, "norm", None), "rmsnorm"), "vision.rope": (vis.rope, "mrope"),
                   "projector.ffn_hidden_size": (p.ffn_hidden_size or merged, merged)}, ARCHITECTURE)
    if not float(vis.tokens_per_second).is_integer():
        raise MappingError(f"vision.tokens_per_second={vis.tokens_per_second}: {ARCHITECTURE} needs a whole number")
    text = parts.text_config_to_hf("qwen2", cfg.foundation, {"mrope_section": cfg.mrope_section})
    vision = dict(depth=e.num_layers, hidden_size=e.hidden_size, num_heads=e.num_attention_heads,
                  intermediate_size=e.ffn_hidden_size, in_channels=e.in_channels, patch_size=e.patch_size,
                  temporal_patch_size=e.temporal_patch_size, spatial_merge_size=e.spatial_merge_size,
                  window_size=e.window_size, fullatt_block_indexes=list(e.full_attention_layers),
                  out_hidden_size=cfg.foundation.hidden_size, tokens_per_second=int(vis.tokens_per_second),
                  hidden_act="silu", initializer_range=e.init_method_std,
                  rope_parameters={"rope_type": "axial", "rope_theta": e.rope_theta})
    hf = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=cfg.foundation.tie_embeddings,
                          architectures=[ARCHITECTURE], **parts.token_ids_to_hf(vis))
    return hf.to_dict()


QWEN2_5_VL_LAYOUT = Layout("qwen2_5_vl", ARCHITECTURE, "qwen2_5_vit", None, qwen2_5_bind, qwen2_5_config_from_hf,
                           qwen2_5_config_to_hf)


@cache
def layouts() -> tuple[Layout, ...]:
    """Every installed layout (``loongforge.vlm.hf_layouts``), by name; two that write the same
    composition or read the same architecture are an error naming both."""
    found = tuple(load_specs(entry_points(group=LAYOUT_GROUP), Layout, "VLM Hugging Face layout").values())
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            if a.architecture == b.architecture:
                raise MappingError(f"VLM Hugging Face layouts {a.name!r} and {b.name!r} both read {a.architecture}")
    return found


def layout_of(cfg) -> Layout:
    """The layout that writes a composition: the one of its encoder (and foundation) family."""
    writers = [layout for layout in layouts() if layout.writes(cfg)]
    if len(writers) > 1:
        raise MappingError(f"encoder.family={cfg.encoder.family!r}, foundation.family={cfg.foundation.family!r}: "
                           f"layouts {', '.join(repr(w.name) for w in writers)} all write this composition")
    if writers:
        return writers[0]
    known = ", ".join(f"{lay.encoder_family} + {'/'.join(lay.foundation_families or ('any',))} ({lay.architecture})"
                      for lay in layouts())
    raise MappingError(f"encoder.family={cfg.encoder.family!r}, foundation.family={cfg.foundation.family!r}: no "
                       f"Hugging Face layout writes this composition; layouts: {known}")


def config_from_hf(raw: dict):
    """``config.json`` -> ``VLMModelConfig``, by the layout of its ``architectures``."""
    archs = raw.get("architectures") or []
    for layout in layouts():
        if layout.architecture in archs:
            return layout.config_from_hf(raw)
    raise MappingError(f"config.json: architectures {archs!r}: none of "
                       f"{', '.join(layout.architecture for layout in layouts())}")


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> ``config.json`` of its layout."""
    return layout_of(cfg).config_to_hf(cfg)


def train_data(cfg) -> dict:
    """The ``data`` settings a model converted from its layout trains with (tiling, placeholders);
    empty where the defaults fit."""
    layout = layout_of(cfg)
    return layout.train_data(cfg) if layout.train_data is not None else {}


@dataclass(frozen=True)
class VLMHFAdapter(HFAdapter):
    """The ``vlm`` family's adapter: each layout binds its own tables (``mapping`` is unused)."""

    def bind(self, cfg):
        return layout_of(cfg).bind(cfg)


def hf_adapter() -> VLMHFAdapter:
    """The family's adapter over every installed layout's architecture."""
    return VLMHFAdapter(architectures=tuple(layout.architecture for layout in layouts()), mapping=QWEN_VIT_MAPPING,
                        config_from_hf=config_from_hf, config_to_hf=config_to_hf)
