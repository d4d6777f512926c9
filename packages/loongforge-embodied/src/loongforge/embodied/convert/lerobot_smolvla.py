"""LeRobot's SmolVLA layout (``lerobot.policies.smolvla``) as a table of the core mapping engine, and
its ``SmolVLAConfig`` (a saved policy's ``config.json``) <-> ``policies.smolvla.SmolVLAConfig``.

HF-side names are ``VLAFlowMatching``'s state-dict names (a saved ``SmolVLAPolicy`` prefixes them
with ``model.``; both spellings are accepted); LF-side names are ``SmolVLAPolicy``'s. The VLM is
``vlm_with_expert.vlm`` (a transformers ``SmolVLMForConditionalGeneration`` cut to its first
``num_vlm_layers`` text layers), the expert ``vlm_with_expert.lm_expert`` (a Llama model without
token embeddings). Every tensor maps one to one, ``lm_head`` included (SmolVLA never runs it; it is
kept so a round trip is exact).

LeRobot's config names the VLM by its hub id (``vlm_model_name``) and reads its sizes from the
hub; the sizes of the VLMs LeRobot ships SmolVLA with are listed here (``SMOLVLM_VARIANTS``), so
no download is needed. The expert's width is ``int(VLM width * expert_width_multiplier)``, its MLP
LeRobot's ``get_intermediate_size`` of that width.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from loongforge.core.hf_mapping import HFMapping, MappingError, Rule
from loongforge.embodied.config import GemmaConfig, VisionConfig
from loongforge.embodied.convert.lerobot_layout import (
    GEMMA_LAYER,
    VISION_LAYER,
    VISION_TOP,
    LeRobotAdapter,
    LeRobotLayout,
    same_names,
)


@dataclass(frozen=True)
class SmolVLMVariant:
    """The sizes of one SmolVLM checkpoint (its ``config.json``) that SmolVLA's weights depend on."""

    text: GemmaConfig
    vision: VisionConfig
    image_size: int
    scale_factor: int
    vocab_size: int


SMOLVLM_VARIANTS = {  # the published config.json of each hub id
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": SmolVLMVariant(
        text=GemmaConfig(width=960, depth=32, mlp_dim=2560, num_heads=15, num_kv_heads=5, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0),
        vision=VisionConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, patch_size=16),
        image_size=512, scale_factor=4, vocab_size=49280),
}

VLM = "vlm_with_expert.vlm."
TEXT = VLM + "model.text_model."
VISION = VLM + "model.vision_model."
EXPERT = "vlm_with_expert.lm_expert."
HEADS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")

SMOLVLA_MAPPING = HFMapping(
    rules=(
        *(Rule(VISION + n, "vision_model." + n) for n in VISION_TOP),
        *(Rule(VISION + "encoder.layers.{vision_layer}." + n, "vision_model.encoder.layers.{vision_layer}." + n)
          for n in VISION_LAYER),
        Rule(VLM + "model.connector.modality_projection.proj.weight", "connector.modality_projection.proj.weight"),
        Rule(TEXT + "embed_tokens.weight", "embed_tokens.weight"),
        *(Rule(TEXT + "layers.{layer}." + n, "layers.{layer}.vlm." + n) for n in GEMMA_LAYER),
        Rule(TEXT + "norm.weight", "norm.weight"),
        Rule(VLM + "lm_head.weight", "lm_head.weight"),
        *(Rule(EXPERT + "layers.{layer}." + n, "layers.{layer}.expert." + n) for n in GEMMA_LAYER),
        Rule(EXPERT + "norm.weight", "expert_norm.weight"),
        *(Rule(n, n) for n in same_names(*HEADS)),
    ),
    ranges={"layer": "layers", "vision_layer": "vision_layers"},
)


def get_intermediate_size(width: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    """LeRobot's MLP width of the SmolVLA expert: 4 * (2/3 width), rounded up to a multiple of 256."""
    hidden = multiplier * int(2 * width / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# LeRobot SmolVLAConfig key -> SmolVLAConfig field, the same value on both sides
SAME = {"chunk_size": "chunk_size", "max_state_dim": "max_state_dim", "max_action_dim": "max_action_dim",
        "num_steps": "num_inference_steps", "min_period": "min_period", "max_period": "max_period",
        "tokenizer_max_length": "max_token_len", "self_attn_every_n_layers": "self_attn_every_n_layers",
        "train_expert_only": "train_expert_only", "freeze_vision_encoder": "freeze_vision_encoder",
        "train_state_proj": "train_state_proj"}
# what LeRobot's SmolVLA hard-codes and SmolVLAConfig keeps as a field
FIXED = {"discrete_state": False, "time_sampling": "beta", "time_beta_alpha": 1.5, "time_beta_beta": 1.0,
         "time_scale": 0.999, "time_offset": 0.001}
UNSUPPORTED = {"add_image_special_tokens": False, "adapt_to_pi_aloha": False, "use_delta_joint_actions_aloha": False}


def _required(raw: dict, key: str, source: str):
    if key not in raw:
        raise MappingError(f"{source}: no {key!r}")
    return raw[key]


def config_from_lerobot(raw: dict):
    """LeRobot's ``SmolVLAConfig`` as a dict (its ``config.json``) -> ``SmolVLAConfig``."""
    from loongforge.embodied.config import policy_config_class  # the family's class, through the registry

    source = "LeRobot smolvla config"
    if raw.get("type", "smolvla") != "smolvla":
        raise MappingError(f"{source}: type={raw['type']!r}; only smolvla maps onto the smolvla family")
    name = _required(raw, "vlm_model_name", source)
    if name not in SMOLVLM_VARIANTS:
        raise MappingError(f"{source}: vlm_model_name={name!r}; one of {', '.join(SMOLVLM_VARIANTS)}")
    variant = SMOLVLM_VARIANTS[name]
    for key, needed in UNSUPPORTED.items():
        if raw.get(key, needed) != needed:
            raise MappingError(f"{source}: {key}={raw[key]!r}; the smolvla family supports only {needed!r}")
    if int(raw.get("prefix_length", -1)) > 0:
        raise MappingError(f"{source}: prefix_length={raw['prefix_length']}; the smolvla family pads no prefix (-1)")
    depth = int(raw.get("num_vlm_layers", variant.text.depth))
    depth = depth if depth > 0 else variant.text.depth
    experts = int(raw.get("num_expert_layers", -1))
    if experts > 0 and experts != depth:
        raise MappingError(f"{source}: num_expert_layers={experts}; the smolvla family pairs one expert layer with each "
                           f"of the {depth} VLM layers (-1 or {depth})")
    cross = "cross" in str(raw.get("attention_mode", "cross_attn"))
    every = int(raw.get("self_attn_every_n_layers", 2)) if cross else 1
    if every < 1:
        raise MappingError(f"{source}: self_attn_every_n_layers={every}; the smolvla family needs >= 1 in cross_attn mode")
    height, width = _required(raw, "resize_imgs_with_padding", source)
    if (height, width) != (variant.image_size, variant.image_size):
        raise MappingError(f"{source}: resize_imgs_with_padding={[height, width]}; {name} reads "
                           f"{variant.image_size}x{variant.image_size} images")
    expert_width = int(variant.text.width * float(_required(raw, "expert_width_multiplier", source)))
    text = asdict(variant.text)
    features = raw.get("input_features") or {}
    cameras = sum(1 for f in features.values() if isinstance(f, dict) and f.get("type") == "VISUAL")
    cameras += int(raw.get("empty_cameras", 0))
    # the config's fields: LeRobot's config.json values and the SmolVLM variant's sizes
    fields: dict[str, Any] = {ours: _required(raw, key, source) for key, ours in SAME.items()
                              if key != "self_attn_every_n_layers"}
    fields.update(FIXED)
    if cameras:
        fields["num_cameras"] = cameras
    fields.update(
        self_attn_every_n_layers=every,
        image_size=variant.image_size,
        scale_factor=variant.scale_factor,
        vocab_size=variant.vocab_size,
        vision=VisionConfig(**asdict(variant.vision)),
        vlm=GemmaConfig(**{**text, "depth": depth}),
        expert=GemmaConfig(**{**text, "depth": depth, "width": expert_width, "mlp_dim": get_intermediate_size(expert_width)}),
    )
    return policy_config_class("smolvla")(**fields)


def config_to_lerobot(cfg) -> dict:
    """``SmolVLAConfig`` -> the fields of LeRobot's ``SmolVLAConfig`` it fixes (``type`` included)."""
    theirs = "LeRobot's SmolVLAConfig"
    name = next((n for n, v in SMOLVLM_VARIANTS.items()
                 if (v.vision, v.image_size, v.scale_factor, v.vocab_size) == (cfg.vision, cfg.image_size, cfg.scale_factor,
                                                                              cfg.vocab_size)
                 and {**asdict(v.text), "depth": cfg.vlm.depth} == asdict(cfg.vlm)), None)
    if name is None:
        raise MappingError(f"model.vlm={cfg.vlm}, model.vision={cfg.vision}: {theirs} builds only the VLMs "
                           f"{', '.join(SMOLVLM_VARIANTS)} (cut to their first layers)")
    multiplier = cfg.expert.width / cfg.vlm.width
    expected = GemmaConfig(**{**asdict(cfg.vlm), "width": cfg.expert.width, "mlp_dim": get_intermediate_size(cfg.expert.width)})
    if cfg.expert != expected or int(cfg.vlm.width * multiplier) != cfg.expert.width:
        raise MappingError(f"model.expert={cfg.expert}: {theirs} derives the expert from the VLM ({expected})")
    for key, needed in FIXED.items():
        if getattr(cfg, key) != needed:
            raise MappingError(f"model.{key}={getattr(cfg, key)!r}: {theirs} has {needed!r}")
    return {"type": "smolvla", "vlm_model_name": name, "num_vlm_layers": cfg.vlm.depth, "num_expert_layers": -1,
            "attention_mode": "cross_attn", "expert_width_multiplier": multiplier,
            **{key: getattr(cfg, ours) for key, ours in SAME.items()}, **UNSUPPORTED, "prefix_length": -1,
            "n_action_steps": cfg.chunk_size, "resize_imgs_with_padding": [cfg.image_size, cfg.image_size]}


@dataclass(frozen=True)
class SmolVLAAdapter(LeRobotAdapter):
    """The smolvla family's LeRobot adapter: the table binds to the VLM and vision depths."""

    def layout(self, cfg) -> LeRobotLayout:
        return cfg if isinstance(cfg, LeRobotLayout) else LeRobotLayout(cfg.vlm.depth, cfg.vision.num_layers)

    def layout_from_state(self, state, side: str) -> LeRobotLayout:
        counts = self.mapping.counts_in(list(state), side=side)
        return LeRobotLayout(counts["layer"], counts["vision_layer"])

    def recognises(self, bare_names: list[str]) -> bool:
        return any(n.startswith("vlm_with_expert.") for n in bare_names)


LEROBOT_SMOLVLA_ADAPTER = SmolVLAAdapter(architectures=(), mapping=SMOLVLA_MAPPING, config_from_hf=config_from_lerobot,
                                         config_to_hf=config_to_lerobot, policy_class="SmolVLAPolicy",
                                         lerobot_type="smolvla")
