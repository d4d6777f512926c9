"""LeRobot's Pi0.5 layout (``lerobot.policies.pi05``) as a table of the core mapping engine.

HF-side names are ``PI05Pytorch``'s state-dict names; a saved ``PI05Policy`` prefixes every key
with ``model.`` (``PI05Policy.model`` is the ``PI05Pytorch``), and both spellings are accepted.
LF-side names are ``Pi05Policy``'s. Apart from the renames, LeRobot's PaliGemma ``lm_head`` is
tied to the token embedding (``Tied``: read only when a checkpoint lacks the embedding, written
as its copy) and its action expert's ``lm_head`` is never used by Pi0.5 (``Unused``: dropped,
written as zeros ``[vocab_size, expert width]``). A name the table does not know, or a tensor it
needs that is missing, is a ``MappingError`` naming it.

The table binds to a ``Pi05Layout``: the numbers that fix the names (Gemma and SigLIP depths)
and the shapes export writes. ``layout_of(policy config)`` gives it for a configured policy;
without a config it is read off the state dict's own names (``HFMapping.counts_in``).
``LEROBOT_PI05_ADAPTER`` is the pi05 family's ``ModelSpec.hf_adapter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loongforge.core.hf_mapping import BoundMapping, HFAdapter, HFMapping, Rule, Tied, Unused
from loongforge.embodied.convert.lerobot_pi05_config import config_from_lerobot, config_to_lerobot

LEROBOT_POLICY_PREFIX = "model."
_PG = "paligemma_with_expert.paligemma."
_LM = _PG + "model.language_model."
_VIT = _PG + "model.vision_tower."
_EX = "paligemma_with_expert.gemma_expert."

_WB = ("weight", "bias")
_ATTENTION = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
# the state-dict names under one layer / module, the same on both sides
_VISION_LAYER = (*(f"layer_norm{i}.{p}" for i in (1, 2) for p in _WB), *(f"mlp.fc{i}.{p}" for i in (1, 2) for p in _WB),
                 *(f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v", "out") for p in _WB))
_VISION_TOP = ("embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
               "embeddings.position_embedding.weight", "post_layernorm.weight", "post_layernorm.bias")
_VLM_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", *_ATTENTION, *_MLP)
_EXPERT_LAYER = (*(f"{n}.dense.{p}" for n in ("input_layernorm", "post_attention_layernorm") for p in _WB), *_ATTENTION, *_MLP)
_HEADS = tuple(f"{m}.{p}" for m in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out") for p in _WB)

PI05_MAPPING = HFMapping(
    rules=(
        *(Rule(_VIT + n, "prefix.vision_tower." + n) for n in _VISION_TOP),
        *(Rule(_VIT + "encoder.layers.{vision_layer}." + n, "prefix.vision_tower.encoder.layers.{vision_layer}." + n)
          for n in _VISION_LAYER),
        *(Rule(_PG + "model.multi_modal_projector.linear." + p, "prefix.multi_modal_projector." + p) for p in _WB),
        Rule(_LM + "embed_tokens.weight", "prefix.embed_tokens.weight"),
        *(Rule(_LM + "layers.{layer}." + n, "layers.{layer}.vlm." + n) for n in _VLM_LAYER),
        Rule(_LM + "norm.weight", "norm.weight"),
        *(Rule(_EX + "model.layers.{layer}." + n, "layers.{layer}.expert." + n) for n in _EXPERT_LAYER),
        *(Rule(_EX + "model.norm.dense." + p, "expert_norm.dense." + p) for p in _WB),
        *(Rule(n, n) for n in _HEADS),
    ),
    ranges={"layer": "layers", "vision_layer": "vision_layers"},
    tied=(Tied(_PG + "lm_head.weight", of=_LM + "embed_tokens.weight"),),
    unused=(Unused(_EX + "lm_head.weight", shape=("vocab_size", "expert_width"), like="action_in_proj.weight"),),
)


@dataclass(frozen=True)
class Pi05Layout:
    """What the table binds to: the joint Gemma depth (backbone and expert), the SigLIP depth
    and, for export's zero ``lm_head`` only, the vocabulary size and the expert width."""

    layers: int
    vision_layers: int
    vocab_size: int | None = None
    expert_width: int | None = None


def layout_of(cfg) -> Pi05Layout:
    """The layout of a ``Pi05Config``."""
    return Pi05Layout(cfg.vlm.depth, cfg.vision.num_layers, cfg.vocab_size, cfg.expert.width)


def _rows(state: Mapping[str, torch.Tensor], name: str) -> int | None:
    return int(state[name].shape[0]) if name in state else None


@dataclass(frozen=True)
class LeRobotAdapter(HFAdapter):
    """The adapter of a policy family with a LeRobot layout: ``bind(policy config)`` binds the
    table to the policy's layout. ``architectures`` is empty: LeRobot's ``config.json`` names a
    policy ``type``, not a transformers architecture, so ``hf_to_lf`` never picks this family."""

    def bind(self, cfg) -> BoundMapping:
        return self.mapping.bind(cfg if isinstance(cfg, Pi05Layout) else layout_of(cfg))


LEROBOT_PI05_ADAPTER = LeRobotAdapter(architectures=(), mapping=PI05_MAPPING, config_from_hf=config_from_lerobot,
                                      config_to_hf=config_to_lerobot)


def from_lerobot_pi05(state_dict: Mapping[str, torch.Tensor], cfg=None, *, partial: bool = False) -> dict[str, torch.Tensor]:
    """A LeRobot ``PI05Policy`` / ``PI05Pytorch`` state dict in ``Pi05Policy`` names, for the
    policy config ``cfg`` (default: the layout its names show). ``partial`` converts the tensors
    that are there (gradients of a subset of parameters) instead of requiring all of them."""
    bare = {k.removeprefix(LEROBOT_POLICY_PREFIX): v for k, v in state_dict.items()}
    if cfg is not None:
        layout = layout_of(cfg)
    else:
        counts = PI05_MAPPING.counts_in(bare, side="hf")
        layout = Pi05Layout(counts["layer"], counts["vision_layer"])
    bound = PI05_MAPPING.bind(layout)
    bound.check_hf(bare, source="LeRobot pi05 state dict", partial=partial)
    return dict(bound.to_lf(bare.__getitem__, bare, partial=partial))


def to_lerobot_pi05(state_dict: Mapping[str, torch.Tensor], cfg=None, policy_prefix: bool = True) -> dict[str, torch.Tensor]:
    """``Pi05Policy`` weights in LeRobot's names (``model.``-prefixed like a saved
    ``PI05Policy``, bare like ``PI05Pytorch`` with ``policy_prefix=False``), for the policy
    config ``cfg`` (default: the layout its names and shapes show)."""
    if cfg is not None:
        layout = layout_of(cfg)
    else:
        counts = PI05_MAPPING.counts_in(state_dict, side="lf")
        layout = Pi05Layout(counts["layer"], counts["vision_layer"], _rows(state_dict, "prefix.embed_tokens.weight"),
                            _rows(state_dict, "action_in_proj.weight"))
    bound = PI05_MAPPING.bind(layout)
    bound.check_lf(state_dict, source="Pi05Policy state dict")
    prefix = LEROBOT_POLICY_PREFIX if policy_prefix else ""
    return {prefix + name: tensor for name, tensor in bound.to_hf(state_dict.__getitem__)}
