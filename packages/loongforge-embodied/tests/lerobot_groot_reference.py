"""LeRobot's own GR00T N1.7 action head (``lerobot.policies.groot.groot_n1_7.GR00TN17ActionHead``) at a
tiny size, built with LeRobot's constructor from a ``GR00TN17Config`` (offline: the head needs only
diffusers; GR00T's backbone, Cosmos-Reason2-2B, is a hub checkpoint loaded with
``trust_remote_code`` and is not built)."""

from __future__ import annotations

from lerobot.policies.groot.groot_n1_7 import GR00TN17ActionHead, GR00TN17Config
from transformers.feature_extraction_utils import BatchFeature

from loongforge.embodied.convert.lerobot_groot import config_to_lerobot


def build_lerobot_groot_head(cfg) -> GR00TN17ActionHead:
    """LeRobot's head with the sizes of our ``GrootN17Config`` ``cfg``."""
    return GR00TN17ActionHead(GR00TN17Config(**config_to_lerobot(cfg)))


def lerobot_head_loss(head: GR00TN17ActionHead, features, image_mask, context_mask, state, actions, embodiment: int):
    """LeRobot's per-element action loss (its ``forward``; it draws the noise and the time itself)."""
    import torch

    backbone = BatchFeature(data={"backbone_features": features, "backbone_attention_mask": context_mask,
                                  "image_mask": image_mask})
    inputs = BatchFeature(data={"state": state[:, None, :], "action": actions, "action_mask": torch.ones_like(actions),
                                "embodiment_id": torch.full((actions.shape[0],), embodiment, dtype=torch.long)})
    return head(backbone, inputs)["action_loss"]
