"""VLA policies trained with flow matching on action chunks. Each policy family is one module
(its config class, its ``nn.Module`` and its ``ModelSpec``) registered under ``loongforge.models``;
these two helpers find them by name."""

from __future__ import annotations


def policy_config(family: str, **fields):
    """A config of policy ``family`` (its registered config class) with ``fields`` set."""
    from loongforge.embodied.config import policy_config_class

    return policy_config_class(family)(**fields)


def build_policy(cfg):
    """A freshly initialised policy of ``cfg.family`` (weights drawn from the current torch RNG)."""
    from loongforge.core.models import get_model_spec

    return get_model_spec(cfg.family).build(cfg)
