"""The Hugging Face layout of a Qwen3-VL-MoE composition (``Qwen3VLMoeForConditionalGeneration``,
Qwen3-VL-30B-A3B): Qwen3-VL's vision tower and DeepStack tables (``hf_qwen3_vl``) with a
``qwen3_moe`` foundation.

The language model is loongforge-llm's ``qwen3_moe`` table (through the family's public
adapter) with its ``model.`` names under ``model.language_model.``, except the routed experts:
Qwen3-VL-MoE checkpoints store each layer's experts as two fused tensors,
``mlp.experts.gate_up_proj [experts, hidden, 2 * ffn]`` (gate then up along the last axis) and
``mlp.experts.down_proj [experts, ffn, hidden]``; each is one conversion to the layer's per-expert
``linear_fc1`` / ``linear_fc2`` (megatron's ``SequentialMLP``, stacked over a global expert axis).
transformers keeps these tensors transposed in memory ([experts, 2 * ffn, hidden], [experts,
hidden, ffn]) and ``save_pretrained`` writes them so; import reads either, export writes the
released checkpoints' layout, which transformers loads.
"""

from __future__ import annotations

import torch

from loongforge.core.hf_mapping import BoundMapping, HFMapping, MappingError, Rule, Transform, register_transform
from loongforge.core.hf_mapping.transforms import config_value
from loongforge.vlm import hf_config_parts as parts
from loongforge.vlm import hf_qwen3_vl as dense
from loongforge.vlm.hf_layout import Layout

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
EXPERTS = ".mlp.experts."


class FusedExperts(Transform):
    """A layer's fused expert tensor ``[experts, in, out]`` (released layout; ``[experts, out,
    in]``, transformers' in-memory layout, also read) <-> one ``[out, in]`` linear weight per
    expert. ``in``/``out`` are config attributes (``hidden_size``, ``moe_ffn_hidden_size``;
    ``out_factor`` 2 for the fused gate and up projections)."""

    n_hf = 1

    def __init__(self, in_features: str, out_features: str, out_factor: int = 1):
        self.in_features, self.out_features, self.out_factor = in_features, out_features, out_factor

    def _dims(self, ctx) -> tuple[int, int]:
        return (int(config_value(ctx.cfg, self.in_features)),
                int(config_value(ctx.cfg, self.out_features)) * self.out_factor)

    def to_lf(self, tensors, ctx):
        (fused,) = tensors
        n_in, n_out = self._dims(ctx)
        experts = len(ctx.lf)
        if tuple(fused.shape) == (experts, n_in, n_out):
            fused = fused.transpose(1, 2)
        elif tuple(fused.shape) != (experts, n_out, n_in):
            raise MappingError(f"{ctx.hf[0]}: shape {list(fused.shape)}, expected {[experts, n_in, n_out]} (or "
                               f"{[experts, n_out, n_in]})")
        return [w.contiguous().clone() for w in fused.unbind(0)]

    def to_hf(self, tensors, ctx):
        return [torch.stack(tensors).transpose(1, 2).contiguous()]


register_transform("vl_moe_gate_up", FusedExperts("hidden_size", "moe_ffn_hidden_size", out_factor=2))
register_transform("vl_moe_down", FusedExperts("moe_ffn_hidden_size", "hidden_size"))

_LAYER, _OURS = "model.layers.{layer}.mlp.experts.", "decoder.layers.{layer}.mlp.experts.local_experts.{expert}."

FUSED_EXPERTS_MAPPING = HFMapping(
    rules=(
        Rule(_LAYER + "gate_up_proj", _OURS + "linear_fc1.weight", "vl_moe_gate_up"),
        Rule(_LAYER + "down_proj", _OURS + "linear_fc2.weight", "vl_moe_down"),
    ),
    ranges={"layer": "num_layers", "expert": "num_experts"},
    # megatron's SequentialMLP folds local_experts.{i} into one global expert axis
    stacked=(("experts.local_experts.{expert}.", "experts.experts."),),
)


def _foundation_adapter():
    from loongforge.core.models import get_model_spec

    return get_model_spec("qwen3_moe").hf_adapter


def foundation_mapping(foundation) -> BoundMapping:
    """The language model's mapping, in ``model.*`` names: the qwen3_moe table with the
    per-expert tensors replaced by the fused ones."""
    if foundation.first_k_dense:
        raise MappingError(f"foundation.first_k_dense={foundation.first_k_dense}: {ARCHITECTURE} has no dense layers")
    text = _foundation_adapter().bind(foundation)
    kept = [c for c in text.conversions if not any(EXPERTS in n for n in c.hf)]
    shared = BoundMapping(kept, text.locations, text.ignore, tied=text.tied, zeros=text.zeros)
    return shared + FUSED_EXPERTS_MAPPING.bind(foundation)


def bind(cfg):
    """The whole checkpoint's mapping for a ``VLMModelConfig`` of this layout."""
    foundation = foundation_mapping(cfg.foundation).hf_prefix_replaced("model.", "model.language_model.")
    return dense.vision_mapping(cfg) + foundation.prefixed(lf="language_model.")


def config_from_hf(raw: dict):
    """``config.json`` of Qwen3-VL-MoE -> ``VLMModelConfig`` (a qwen3_moe foundation, interleaved mrope)."""
    from transformers import Qwen3VLMoeConfig

    hf = Qwen3VLMoeConfig.from_dict(raw)
    v, t = parts.checked_parts(hf, f"config.json of {ARCHITECTURE}", "gelu_pytorch_tanh", "Qwen3 ViT")
    text = t.to_dict()
    text["norm_topk_prob"] = True  # the Qwen3-VL-MoE router always renormalises its top-k
    text["num_experts"] = t.num_experts
    foundation, section = parts.foundation_from_hf("qwen3_moe", hf, text)
    return dense.composition(v, hf, foundation, section, v.deepstack_visual_indexes)


def config_to_hf(cfg) -> dict:
    """``VLMModelConfig`` -> Qwen3-VL-MoE ``config.json``; a composition it cannot express is an error."""
    from transformers import Qwen3VLMoeConfig

    f = cfg.foundation
    parts.require({"foundation.family": (f.family, "qwen3_moe"),
                   "foundation.moe_router_norm_topk_prob": (f.moe_router_norm_topk_prob, True)}, ARCHITECTURE)
    text = parts.text_config_to_hf("qwen3_moe", f, {"mrope_section": cfg.mrope_section, "mrope_interleaved": True})
    for key in ("norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"):
        text.pop(key, None)
    vision, ids = dense.vision_to_hf(cfg, ARCHITECTURE)
    hf = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=f.tie_embeddings,
                          architectures=[ARCHITECTURE], **ids)
    return hf.to_dict()


LAYOUT = Layout("qwen3_vl_moe", ARCHITECTURE, "qwen3_vit", ("qwen3_moe",), bind, config_from_hf, config_to_hf)
