"""Policy families by name."""

from __future__ import annotations

import torch.nn as nn

from loongforge.embodied.config import PolicyConfig
from loongforge.embodied.policies.groot import GrootPolicy
from loongforge.embodied.policies.pi05 import Pi05Policy

POLICIES: dict[str, type[nn.Module]] = {"pi05": Pi05Policy, "groot": GrootPolicy}


def build_policy(cfg: PolicyConfig) -> nn.Module:
    """A freshly initialised policy (weights drawn from the current torch RNG)."""
    if cfg.name not in POLICIES:
        raise KeyError(f"policy.name={cfg.name!r}: known policies {sorted(POLICIES)}")
    return POLICIES[cfg.name](cfg)
