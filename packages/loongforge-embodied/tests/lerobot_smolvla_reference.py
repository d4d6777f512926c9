"""LeRobot's own SmolVLA (``lerobot.policies.smolvla``) at a tiny size, for equivalence tests.

``SmolVLMWithExpertModel.__init__`` reads the VLM's config and its processor from the hub
(``AutoConfig`` / ``AutoProcessor.from_pretrained(vlm_model_name)``); the processor only gives the
image special-token ids, which SmolVLA reads only with ``add_image_special_tokens`` (off by
default). Here the same LeRobot classes are assembled around a tiny transformers
``SmolVLMForConditionalGeneration`` built from a ``SmolVLMConfig``, setting exactly the attributes
those constructors set (see lerobot/policies/smolvla/smolvlm_with_expert.py and
modeling_smolvla.py); every forward method that runs is LeRobot's (and transformers').
"""

from __future__ import annotations

import copy

import torch.nn as nn
from lerobot.configs import FeatureType, PolicyFeature
from lerobot.policies.smolvla import modeling_smolvla, smolvlm_with_expert
from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
from lerobot.utils.constants import ACTION, OBS_IMAGES, OBS_STATE
from transformers import AutoModel, SmolVLMConfig, SmolVLMForConditionalGeneration

from loongforge.embodied.policies.smolvla import SmolVLAConfig


def smolvlm_config(cfg: SmolVLAConfig) -> SmolVLMConfig:
    """A tiny SmolVLM config (its text model at ``model.vlm``'s full depth)."""
    v, t = cfg.vision, cfg.vlm
    return SmolVLMConfig(
        scale_factor=cfg.scale_factor,
        vision_config=dict(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.num_layers,
                           num_attention_heads=v.num_heads, image_size=cfg.image_size, patch_size=v.patch_size,
                           layer_norm_eps=v.layer_norm_eps),
        text_config=dict(model_type="llama", hidden_size=t.width, intermediate_size=t.mlp_dim, num_hidden_layers=t.depth,
                         num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim,
                         rms_norm_eps=t.rms_norm_eps, vocab_size=cfg.vocab_size, hidden_act="silu"),
    )


def lerobot_config(cfg: SmolVLAConfig, cameras: int = 2, state_dim: int | None = None,
                   action_dim: int | None = None) -> LeRobotSmolVLAConfig:
    size = cfg.image_size
    return LeRobotSmolVLAConfig(
        chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size, max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim, num_steps=cfg.num_inference_steps, min_period=cfg.min_period,
        max_period=cfg.max_period, tokenizer_max_length=cfg.max_token_len, num_vlm_layers=cfg.vlm.depth,
        self_attn_every_n_layers=cfg.self_attn_every_n_layers, expert_width_multiplier=cfg.expert.width / cfg.vlm.width,
        train_expert_only=cfg.train_expert_only, freeze_vision_encoder=cfg.freeze_vision_encoder,
        train_state_proj=cfg.train_state_proj, resize_imgs_with_padding=(size, size), device="cpu",
        input_features={**{f"{OBS_IMAGES}.cam{i}": PolicyFeature(FeatureType.VISUAL, (3, size, size)) for i in range(cameras)},
                        OBS_STATE: PolicyFeature(FeatureType.STATE, (state_dim or cfg.max_state_dim,))},
        output_features={ACTION: PolicyFeature(FeatureType.ACTION, (action_dim or cfg.max_action_dim,))})


def build_smolvlm_with_expert(config: LeRobotSmolVLAConfig, vlm_config: SmolVLMConfig):
    """LeRobot's ``SmolVLMWithExpertModel`` with ``vlm_config`` standing in for the hub's."""
    cls = smolvlm_with_expert.SmolVLMWithExpertModel
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.vlm = SmolVLMForConditionalGeneration(config=vlm_config)
    text = m.get_vlm_model().text_model
    if config.num_vlm_layers > 0:
        text.layers = text.layers[: config.num_vlm_layers]
    m.num_vlm_layers = len(text.layers)
    m.config = vlm_config
    expert_config = copy.deepcopy(vlm_config.text_config)
    width = int(expert_config.hidden_size * config.expert_width_multiplier)
    expert_config.hidden_size = width
    expert_config.intermediate_size = smolvlm_with_expert.get_intermediate_size(width)
    expert_config.num_hidden_layers = m.num_vlm_layers
    m.lm_expert = AutoModel.from_config(expert_config)
    m.num_expert_layers = len(m.lm_expert.layers)
    m.self_attn_every_n_layers = config.self_attn_every_n_layers
    if "cross" in config.attention_mode:
        kv_in = vlm_config.text_config.num_key_value_heads * vlm_config.text_config.head_dim
        kv_out = expert_config.num_key_value_heads * expert_config.head_dim
        for i, layer in enumerate(m.lm_expert.layers):
            if m.self_attn_every_n_layers > 0 and i % m.self_attn_every_n_layers == 0:
                continue
            layer.self_attn.k_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
            layer.self_attn.v_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
    m.lm_expert.embed_tokens = None
    m.num_attention_heads = vlm_config.text_config.num_attention_heads
    m.num_key_value_heads = vlm_config.text_config.num_key_value_heads
    m.freeze_vision_encoder = config.freeze_vision_encoder
    m.train_expert_only = config.train_expert_only
    m.attention_mode = config.attention_mode
    m.expert_hidden_size = width
    m.set_requires_grad()
    return m


def build_lerobot_smolvla(cfg: SmolVLAConfig, config: LeRobotSmolVLAConfig | None = None) -> modeling_smolvla.VLAFlowMatching:
    """LeRobot's ``VLAFlowMatching`` (SmolVLA's model) at ``cfg``'s tiny sizes."""
    config = config or lerobot_config(cfg)
    cls = modeling_smolvla.VLAFlowMatching
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.config = config
    model.vlm_with_expert = build_smolvlm_with_expert(config, smolvlm_config(cfg))
    expert = model.vlm_with_expert.expert_hidden_size
    model.state_proj = nn.Linear(config.max_state_dim, cfg.vlm.width)
    model.action_in_proj = nn.Linear(config.max_action_dim, expert)
    model.action_out_proj = nn.Linear(expert, config.max_action_dim)
    model.action_time_mlp_in = nn.Linear(2 * expert, expert)
    model.action_time_mlp_out = nn.Linear(expert, expert)
    model.set_requires_grad()
    model.add_image_special_tokens = config.add_image_special_tokens
    model.prefix_length = config.prefix_length
    model.rtc_processor = None
    return model


def build_lerobot_smolvla_policy(cfg: SmolVLAConfig, cameras: int = 2) -> modeling_smolvla.SmolVLAPolicy:
    """LeRobot's ``SmolVLAPolicy`` around a tiny ``VLAFlowMatching`` (what ``_save_pretrained`` writes)."""
    config = lerobot_config(cfg, cameras)
    cls = modeling_smolvla.SmolVLAPolicy
    policy = cls.__new__(cls)
    nn.Module.__init__(policy)
    policy.config = config
    policy.rtc_processor = None
    policy.model = build_lerobot_smolvla(cfg, config)
    policy.reset()
    return policy


def smolvla_loss(model: modeling_smolvla.VLAFlowMatching, batch, noise, t):
    """LeRobot's per-element loss (``VLAFlowMatching.forward``) of one of our batches."""
    return model.forward(list(batch["images"].unbind(1)), list(batch["image_mask"].unbind(1)), batch["tokens"],
                         batch["token_mask"], batch["state"], batch["actions"], noise, t)
