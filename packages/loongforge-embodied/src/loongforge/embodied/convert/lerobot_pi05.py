"""LeRobot's Pi0.5 layout (``lerobot.policies.pi05``) as a table of the core mapping engine.

The shared PaliGemma-with-expert table (``lerobot_layout``) with Pi0.5's own parts: the action
expert's norms are adaptive (``*.dense.weight`` / ``*.dense.bias``, adaRMS) and its heads are
``action_in_proj``, ``action_out_proj`` and the time MLP ``time_mlp_in`` / ``time_mlp_out``.
``LEROBOT_PI05_ADAPTER`` is the pi05 family's ``ModelSpec.hf_adapter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial as bind_family

import torch

from loongforge.embodied.convert.lerobot_config import config_from_lerobot, config_to_lerobot
from loongforge.embodied.convert.lerobot_layout import (
    EXPERT_ATTENTION_MLP,
    WB,
    PaliGemmaAdapter,
    from_lerobot,
    lerobot_mapping,
    same_names,
    to_lerobot,
)

_ADARMS = ("input_layernorm", "post_attention_layernorm")

PI05_MAPPING = lerobot_mapping(
    expert_layer=(*(f"{n}.dense.{p}" for n in _ADARMS for p in WB), *EXPERT_ATTENTION_MLP),
    expert_norm=tuple(f"dense.{p}" for p in WB),
    heads=same_names("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"),
)

LEROBOT_PI05_ADAPTER = PaliGemmaAdapter(architectures=(), mapping=PI05_MAPPING,
                                      config_from_hf=bind_family(config_from_lerobot, family="pi05", discrete_state=True),
                                      config_to_hf=bind_family(config_to_lerobot, family="pi05", discrete_state=True),
                                     policy_class="PI05Policy", marker="time_mlp_in.",
                                      lerobot_type="pi05")


def from_lerobot_pi05(state_dict: Mapping[str, torch.Tensor], cfg=None, *, partial: bool = False) -> dict[str, torch.Tensor]:
    """A LeRobot ``PI05Policy`` / ``PI05Pytorch`` state dict in ``Pi05Policy`` names (``lerobot_layout.from_lerobot``)."""
    return from_lerobot(LEROBOT_PI05_ADAPTER, state_dict, cfg, partial=partial, source="LeRobot pi05 state dict")


def to_lerobot_pi05(state_dict: Mapping[str, torch.Tensor], cfg=None, policy_prefix: bool = True) -> dict[str, torch.Tensor]:
    """``Pi05Policy`` weights in LeRobot's ``PI05Policy`` names (``lerobot_layout.to_lerobot``)."""
    return to_lerobot(LEROBOT_PI05_ADAPTER, state_dict, cfg, policy_prefix, source="Pi05Policy state dict")
