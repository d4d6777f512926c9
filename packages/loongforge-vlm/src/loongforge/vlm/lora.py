"""LoRA for ``lf-vlm``: loongforge-llm's tensor-parallel adapters on the megatron linear layers of
the three parts, chosen per part.

``lora.target_modules`` is the shared list (``loongforge.core.training.schema.LoRAConfig``), matched
against the layers' names within their part, with one addition: an entry that starts with a part
name (``encoder.``, ``projector.`` or ``foundation.``) selects only in that part
(``foundation.linear_qkv``: the foundation's fused q/k/v projections; ``encoder.linear_fc1``: the
vision tower's MLP input layers). An entry without one (``linear_proj``) matches in every part; a
``re:REGEX`` entry is matched against the whole model's module names (``language_model.decoder...``,
``encoder.decoder...``, ``projector.mlp.encoder.linear_fc1``). The default adapts the foundation as
``lf-llm`` does.

An adapter trains when its part is in ``trainable`` (as a layer the run freezes keeps its adapter
frozen in every CLI); every base weight is frozen. ``lora.base`` loads a checkpoint of the same
model (a converted Qwen2.5-VL, a previous run) before the adapters are added.
"""

from __future__ import annotations

import re
from dataclasses import replace

from loongforge.core.config import ConfigError
from loongforge.llm.api import LORA_DEFAULT_TARGETS

# the part names of the config (and of `trainable`) -> the model's module of that part
PART_MODULES = {"encoder": "encoder", "projector": "projector", "foundation": "language_model"}
DEFAULT_TARGETS = [f"foundation.{name}" for name in LORA_DEFAULT_TARGETS]  # lf-llm's, on the foundation


def model_targets(targets: list[str]) -> list[str]:
    """``lora.target_modules`` in the model's module names: ``PART.SUFFIX`` becomes a regular
    expression of the part's layers named ``SUFFIX``; other entries stay as they are."""
    out = []
    for target in targets:
        part, dot, suffix = target.partition(".")
        if dot and part in PART_MODULES and not target.startswith("re:"):
            out.append(rf"re:{re.escape(PART_MODULES[part])}\.(.*\.)?{re.escape(suffix)}")
        else:
            out.append(target)
    return out


def add_adapters(model, cfg, model_config: dict, load_initial_weights: bool) -> None:
    """``lora.base`` into ``model`` (a ``VisionLanguageModel``), then its adapters: trainable in the
    parts ``trainable`` names, every other parameter frozen."""
    from loongforge.llm.api import apply_lora, load_base_weights
    from loongforge.vlm.parallel import mark_replicated_parameters

    lora = cfg.lora
    if lora.base and load_initial_weights:
        load_base_weights(model, lora.base, model_config)
    try:
        apply_lora(model, replace(lora, target_modules=model_targets(lora.target_modules)), seed=cfg.train.seed)
    except ValueError as exc:  # no layer matched, or routed experts split over TP
        raise ConfigError(f"lora.target_modules={list(lora.target_modules)}: {exc}") from exc
    refuse_layer_scaled(model, lora.target_modules)
    parts = {"foundation": model.language_model}
    if model.pre_process:
        parts.update(encoder=model.encoder, projector=model.projector)
        for tower in (model.encoder, model.projector):  # the adapters are laid out as the tower's weights
            mark_replicated_parameters(tower, model.groups)
    for name, part in parts.items():
        if name not in cfg.trainable:
            part.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"lora.target_modules={list(lora.target_modules)} adapt no layer of the trainable parts "
                          f"(trainable={list(cfg.trainable)})")


def refuse_layer_scaled(model, targets: list[str]) -> None:
    """An adapter on a layer-scaled linear (InternViT's ``linear_proj``/``linear_fc2``) would add its
    update after the scale, which transformers' model (and PEFT) cannot express: a config error."""
    from loongforge.vlm.encoders.layer_scale import LayerScaledRowParallelLinear

    scaled = [name for name, module in model.named_modules()
              if isinstance(module.__dict__.get("base"), LayerScaledRowParallelLinear)]
    if scaled:
        raise ConfigError(f"lora.target_modules={list(targets)} adapt {scaled[0]}, a layer-scaled output linear whose "
                          f"adapter would add after the scale; target encoder.linear_qkv or encoder.linear_fc1 instead")


def lora_layouts(manifest: dict, names: list[str]):
    """``convert lora-to-peft``: every part's adapters under the module names of transformers'
    ``Qwen2_5_VLForConditionalGeneration`` (``base_model.model.model.language_model.layers.0.self_attn.q_proj``,
    ``...model.visual.blocks.0.attn.qkv``, ``...model.visual.merger.mlp.0``), fused layers split as
    the HF mapping splits their weights."""
    from loongforge.core.lora import transformers_layout
    from loongforge.vlm.hf import module_name

    return [transformers_layout(manifest, module_name=module_name)]
