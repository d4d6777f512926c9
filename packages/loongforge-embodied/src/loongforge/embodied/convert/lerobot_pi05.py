"""LeRobot ``PI05Policy`` state-dict names <-> ``Pi05Policy`` names.

LeRobot saves its Pi0.5 policy (``lerobot.policies.pi05.modeling_pi05``) with every key under
``model.`` (``PI05Policy.model`` is a ``PI05Pytorch``); both prefixed and bare keys are accepted.
LeRobot's PaliGemma ``lm_head`` is tied to the token embedding and its action expert's
``lm_head`` is never used by Pi0.5; neither exists here (export writes the tie and zeros).
"""

from __future__ import annotations

import torch

from loongforge.embodied.convert.mapping import NameMap, Rule

LEROBOT_POLICY_PREFIX = "model."
_PG = "paligemma_with_expert.paligemma."
_EX = "paligemma_with_expert.gemma_expert."

PI05_RULES = [
    Rule(_PG + "model.vision_tower.{rest}", "prefix.vision_tower.{rest}"),
    Rule(_PG + "model.multi_modal_projector.linear.{rest}", "prefix.multi_modal_projector.{rest}"),
    Rule(_PG + "model.language_model.embed_tokens.weight", "prefix.embed_tokens.weight"),
    Rule(_PG + "model.language_model.layers.{i}.{rest}", "layers.{i}.vlm.{rest}"),
    Rule(_PG + "model.language_model.norm.weight", "norm.weight"),
    Rule(_EX + "model.layers.{i}.{rest}", "layers.{i}.expert.{rest}"),
    Rule(_EX + "model.norm.{rest}", "expert_norm.{rest}"),
    Rule("action_in_proj.{rest}", "action_in_proj.{rest}"),
    Rule("action_out_proj.{rest}", "action_out_proj.{rest}"),
    Rule("time_mlp_in.{rest}", "time_mlp_in.{rest}"),
    Rule("time_mlp_out.{rest}", "time_mlp_out.{rest}"),
    Rule(_PG + "lm_head.weight", "prefix.embed_tokens.weight", kind="tied"),
    Rule(
        _EX + "lm_head.weight",
        "action_in_proj.weight",
        kind="unused",
        shape=lambda sd: (sd["prefix.embed_tokens.weight"].shape[0], sd["action_in_proj.weight"].shape[0]),
    ),
]

PI05_MAP = NameMap("lerobot pi05", PI05_RULES)


def from_lerobot_pi05(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LeRobot ``PI05Policy`` / ``PI05Pytorch`` state dict in ``Pi05Policy`` names."""
    bare = {k.removeprefix(LEROBOT_POLICY_PREFIX): v for k, v in state_dict.items()}
    return PI05_MAP.source_to_target(bare)


def to_lerobot_pi05(state_dict: dict[str, torch.Tensor], policy_prefix: bool = True) -> dict[str, torch.Tensor]:
    """``Pi05Policy`` weights in LeRobot names (``model.``-prefixed like a saved ``PI05Policy``)."""
    out = PI05_MAP.target_to_source(state_dict)
    return {LEROBOT_POLICY_PREFIX + k: v for k, v in out.items()} if policy_prefix else out
