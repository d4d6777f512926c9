"""LeRobot's ``PI0Config`` / ``PI05Config`` (a saved policy's ``config.json``) <-> ``Pi0Config`` /
``Pi05Config``: the family's module binds ``family`` (its LeRobot ``type``) and ``discrete_state``
(whether the family puts the 256-bin state in the prompt) into its adapter.

LeRobot builds Pi0 and Pi0.5 only at the released sizes: a PaliGemma backbone and an action expert, each
a named Gemma variant (``gemma_2b`` / ``gemma_300m``), with the SigLIP-so400m tower and
PaliGemma's vocabulary. The translation covers what fixes the weights and the flow-matching
schedule; the dataset's features and normalisation stay LeRobot's (not written; cameras are
read from the ``VISUAL`` input features when listed). A value one side cannot express is a
``MappingError`` naming the key.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.config import GemmaConfig, VisionConfig

GEMMA_VARIANTS = {  # LeRobot's get_gemma_config (openpi's gemma.get_config)
    "gemma_2b": GemmaConfig(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_300m": GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
}
SIGLIP_SO400M = VisionConfig(hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304, patch_size=14)
PALIGEMMA_VOCAB_SIZE = 257152
# LeRobot PI0Config / PI05Config key -> Pi0Config / Pi05Config field, the same value on both sides
SAME = {"chunk_size": "chunk_size", "max_state_dim": "max_state_dim", "max_action_dim": "max_action_dim",
        "num_inference_steps": "num_inference_steps", "time_sampling_beta_alpha": "time_beta_alpha",
        "time_sampling_beta_beta": "time_beta_beta", "time_sampling_scale": "time_scale",
        "time_sampling_offset": "time_offset", "min_period": "min_period", "max_period": "max_period",
        "tokenizer_max_length": "max_token_len"}
VARIANT_KEYS = {"paligemma_variant": "vlm", "action_expert_variant": "expert"}


def _required(raw: dict, key: str, source: str):
    if key not in raw:
        raise MappingError(f"{source}: no {key!r}")
    return raw[key]


def config_from_lerobot(raw: dict, family: str, discrete_state: bool):
    """A LeRobot ``PI0Config`` / ``PI05Config`` as a dict (its ``config.json``) -> the config of ``family``."""
    from loongforge.embodied.config import policy_config_class

    source = f"LeRobot {family} config"
    if raw.get("type", family) != family:
        raise MappingError(f"{source}: type={raw['type']!r}; only {family} maps onto the {family} family")
    gemma = {}
    for key, part in VARIANT_KEYS.items():
        variant = _required(raw, key, source)
        if variant not in GEMMA_VARIANTS:
            raise MappingError(f"{source}: {key}={variant!r}; one of {', '.join(GEMMA_VARIANTS)}")
        gemma[part] = GemmaConfig(**asdict(GEMMA_VARIANTS[variant]))
    height, width = _required(raw, "image_resolution", source)
    if height != width:
        raise MappingError(f"{source}: image_resolution={[height, width]}; the {family} family takes square images")
    features = raw.get("input_features") or {}
    cameras = sum(1 for f in features.values() if isinstance(f, dict) and f.get("type") == "VISUAL")
    cameras += int(raw.get("empty_cameras", 0))
    fields: dict[str, Any] = {ours: _required(raw, key, source) for key, ours in SAME.items()}
    fields.update(gemma)  # vlm, expert
    if cameras:
        fields["num_cameras"] = cameras
    return policy_config_class(family)(
        **fields,
        image_size=int(height),
        vocab_size=PALIGEMMA_VOCAB_SIZE,
        discrete_state=discrete_state,
        time_sampling="beta",
        vision=VisionConfig(**asdict(SIGLIP_SO400M)),
    )


def config_to_lerobot(cfg, family: str, discrete_state: bool) -> dict:
    """``Pi0Config`` / ``Pi05Config`` -> the fields of LeRobot's ``PI0Config`` / ``PI05Config`` it
    fixes (``type`` included)."""
    theirs = f"LeRobot's {family.upper()}Config"
    variants = {}
    for key, part in VARIANT_KEYS.items():
        ours = getattr(cfg, part)
        variants[key] = next((name for name, v in GEMMA_VARIANTS.items() if v == ours), None)
        if variants[key] is None:
            raise MappingError(f"model.{part}={ours}: {theirs} builds only the Gemma variants "
                               f"{', '.join(GEMMA_VARIANTS)}")
    fixed = {"vision": (cfg.vision, SIGLIP_SO400M), "vocab_size": (cfg.vocab_size, PALIGEMMA_VOCAB_SIZE),
             "discrete_state": (cfg.discrete_state, discrete_state), "time_sampling": (cfg.time_sampling, "beta")}
    for key, (value, needed) in fixed.items():
        if value != needed:
            raise MappingError(f"model.{key}={value!r}: {theirs} has {needed!r}")
    return {"type": family, **variants, **{key: getattr(cfg, ours) for key, ours in SAME.items()},
            "n_action_steps": cfg.chunk_size, "image_resolution": [cfg.image_size, cfg.image_size]}
