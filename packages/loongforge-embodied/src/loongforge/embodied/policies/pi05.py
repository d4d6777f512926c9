"""Pi0.5-style VLA policy.

The backbone + action expert of ``action_expert`` (PaliGemma-style prefix of cameras and prompt,
with ``discrete_state`` the 256-bin state tokens in the prompt; the noisy action chunk as the
expert's one suffix block). The flow-matching time enters the expert through adaptive RMSNorm
(Pi0.5's adaRMS), from a two-layer swish MLP of its sinusoidal embedding.

Parameter names follow LeRobot's ``PI05Pytorch`` closely enough that ``convert.lerobot_pi05``
is a table of renames of the core mapping engine; it is the family's ``hf_adapter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.core.models import ModelSpec
from loongforge.embodied.convert.lerobot_pi05 import LEROBOT_PI05_ADAPTER
from loongforge.embodied.policies.action_expert import ActionExpertConfig, ActionExpertPolicy, suffix_masks
from loongforge.embodied.policies.flow_matching import sinusoidal_embedding
from loongforge.embodied.task import PolicyTask


@dataclass
class Pi05Config(ActionExpertConfig):
    """Pi0.5: the backbone + action expert policy with the time in the expert's adaptive RMSNorm and
    (``discrete_state``) the state as 256-bin tokens of the prompt."""

    family: str = "pi05"


class Pi05Policy(ActionExpertPolicy):
    family = "pi05"

    def __init__(self, cfg: Pi05Config):
        super().__init__(cfg, expert_cond_dim=cfg.expert.width)
        width = cfg.expert.width
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)
        self.finish_init()

    def embed_suffix(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor):
        """The noisy chunk as one block (it sees the prefix, the prefix never sees it); the time
        embedding as the adaRMS condition."""
        cfg = self.cfg
        temb = sinusoidal_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb.to(self.time_mlp_in.weight.dtype)))))
        tokens = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        pad, att = suffix_masks((tokens.shape[1],), tokens.shape[0], tokens.device)
        return tokens, pad, att, cond


PI05_SPEC = ModelSpec(
    name="pi05",
    config_class=Pi05Config,
    build=Pi05Policy,
    engine="torch",
    task=PolicyTask,
    hf_adapter=LEROBOT_PI05_ADAPTER,
)
