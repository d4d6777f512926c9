"""Pi0-style VLA policy.

The backbone + action expert of ``action_expert``, with Pi0's suffix: one continuous state token
(the padded, normalised state through a linear layer) followed by the noisy action chunk. The
flow-matching time is fused into every action token by an MLP over the concatenated action and
sinusoidal time embeddings (linear, swish, linear); the expert's norms are plain RMSNorms. The
state token is its own block (it sees the prefix and itself), the chunk another (it sees the
prefix, the state and itself); the prefix sees neither. The prompt is the instruction alone.

Parameter names follow LeRobot's ``PI0Pytorch`` closely enough that ``convert.lerobot_pi0`` is a
table of renames of the core mapping engine; it is the family's ``hf_adapter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.core.models import ModelSpec
from loongforge.embodied.convert.lerobot_pi0 import LEROBOT_PI0_ADAPTER
from loongforge.embodied.policies.action_expert import ActionExpertConfig, ActionExpertPolicy, suffix_masks
from loongforge.embodied.policies.flow_matching import sinusoidal_embedding
from loongforge.embodied.task import PolicyTask


@dataclass
class Pi0Config(ActionExpertConfig):
    """Pi0: the backbone + action expert policy with a continuous state token and the time fused
    into the action tokens (an action-time MLP)."""

    family: str = "pi0"
    discrete_state: bool = False  # the state enters as one continuous token of the action expert

    def __post_init__(self):
        super().__post_init__()
        if self.discrete_state:
            raise ValueError("model.discrete_state=true: Pi0 reads the state as a continuous token, not in the prompt")


class Pi0Policy(ActionExpertPolicy):
    family = "pi0"

    def __init__(self, cfg: Pi0Config):
        super().__init__(cfg, expert_cond_dim=None)
        width = cfg.expert.width
        self.state_proj = nn.Linear(cfg.max_state_dim, width)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        # the heads keep PyTorch's default Linear initialisation, as in LeRobot's PI0Pytorch: at
        # Normal(0, 0.02) the action-time MLP shrinks the noisy actions ~1000-fold and the expert's
        # residual stream barely sees them (the debug policy then hardly learns)
        self.finish_init(keep_init=(self.state_proj, self.action_in_proj, self.action_time_mlp_in,
                                    self.action_time_mlp_out, self.action_out_proj))

    def embed_suffix(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor):
        """The state token, then the chunk's action-time tokens: two blocks; no expert condition."""
        cfg = self.cfg
        dtype = self.action_in_proj.weight.dtype
        state = self.state_proj(batch["state"].to(dtype))[:, None, :]
        actions = self.action_in_proj(x_t.to(dtype))
        temb = sinusoidal_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period).to(actions.dtype)
        fused = torch.cat([actions, temb[:, None, :].expand_as(actions)], dim=2)
        actions = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        pad, att = suffix_masks((1, actions.shape[1]), actions.shape[0], actions.device)
        return torch.cat([state, actions], 1), pad, att, None


PI0_SPEC = ModelSpec(
    name="pi0",
    config_class=Pi0Config,
    build=Pi0Policy,
    engine="torch",
    task=PolicyTask,
    hf_adapter=LEROBOT_PI0_ADAPTER,
)
