"""LeRobot's Pi0 layout (``lerobot.policies.pi0``) as a table of the core mapping engine.

The shared PaliGemma-with-expert table (``lerobot_layout``) with Pi0's own parts: the action
expert's norms are plain Gemma RMSNorms (``input_layernorm.weight``, ..., ``model.norm.weight``)
and its heads are ``state_proj`` (the continuous state token), ``action_in_proj``,
``action_out_proj`` and the action-time MLP ``action_time_mlp_in`` / ``action_time_mlp_out``.
``LEROBOT_PI0_ADAPTER`` is the pi0 family's ``ModelSpec.hf_adapter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial as bind_family

import torch

from loongforge.embodied.convert.lerobot_config import config_from_lerobot, config_to_lerobot
from loongforge.embodied.convert.lerobot_layout import (
    GEMMA_LAYER,
    PaliGemmaAdapter,
    from_lerobot,
    lerobot_mapping,
    same_names,
    to_lerobot,
)

PI0_MAPPING = lerobot_mapping(
    expert_layer=GEMMA_LAYER,
    expert_norm=("weight",),
    heads=same_names("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"),
)

LEROBOT_PI0_ADAPTER = PaliGemmaAdapter(architectures=(), mapping=PI0_MAPPING,
                                     config_from_hf=bind_family(config_from_lerobot, family="pi0", discrete_state=False),
                                     config_to_hf=bind_family(config_to_lerobot, family="pi0", discrete_state=False),
                                     policy_class="PI0Policy", marker="state_proj.", lerobot_type="pi0")


def from_lerobot_pi0(state_dict: Mapping[str, torch.Tensor], cfg=None, *, partial: bool = False) -> dict[str, torch.Tensor]:
    """A LeRobot ``PI0Policy`` / ``PI0Pytorch`` state dict in ``Pi0Policy`` names (``lerobot_layout.from_lerobot``)."""
    return from_lerobot(LEROBOT_PI0_ADAPTER, state_dict, cfg, partial=partial, source="LeRobot pi0 state dict")


def to_lerobot_pi0(state_dict: Mapping[str, torch.Tensor], cfg=None, policy_prefix: bool = True) -> dict[str, torch.Tensor]:
    """``Pi0Policy`` weights in LeRobot's ``PI0Policy`` names (``lerobot_layout.to_lerobot``)."""
    return to_lerobot(LEROBOT_PI0_ADAPTER, state_dict, cfg, policy_prefix, source="Pi0Policy state dict")
