"""LeRobot's own Pi0.5 modules (``lerobot.policies.pi05``) at a tiny size, for equivalence tests.

LeRobot's constructors only build the released sizes: ``PI05Pytorch.__init__`` looks up the
``gemma_2b`` / ``gemma_300m`` variants and ``PaliGemmaWithExpertModel.__init__`` fixes the
SigLIP-so400m vision tower (27 layers, width 1152, projection 2048). Here the same LeRobot classes
are assembled with tiny configs, setting exactly the attributes those constructors set (see
lerobot/policies/pi05/modeling_pi05.py); every forward method that runs is LeRobot's.
"""

from __future__ import annotations

import torch.nn as nn
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.modeling_pi05 import PaliGemmaWithExpertModel, PI05Pytorch
from lerobot.policies.pi_gemma import PaliGemmaForConditionalGenerationWithPiGemma, PiGemmaForCausalLM
from transformers.models.auto import CONFIG_MAPPING

from loongforge.embodied.config import PolicyConfig


def build_lerobot_pi05(cfg: PolicyConfig) -> PI05Pytorch:
    vlm, expert, vis = cfg.vlm, cfg.expert, cfg.vision
    vlm_hf = CONFIG_MAPPING["paligemma"]()
    vlm_hf._vocab_size = cfg.vocab_size
    vlm_hf.image_token_index = cfg.vocab_size
    t = vlm_hf.text_config
    t.hidden_size, t.intermediate_size, t.num_attention_heads = vlm.width, vlm.mlp_dim, vlm.num_heads
    t.head_dim, t.num_hidden_layers, t.num_key_value_heads = vlm.head_dim, vlm.depth, vlm.num_kv_heads
    t.hidden_activation, t.dtype, t.vocab_size = "gelu_pytorch_tanh", "float32", cfg.vocab_size
    t.use_adarms, t.adarms_cond_dim = False, None
    v = vlm_hf.vision_config
    v.image_size, v.patch_size, v.hidden_size = cfg.image_size, vis.patch_size, vis.hidden_size
    v.intermediate_size, v.num_hidden_layers, v.num_attention_heads = vis.intermediate_size, vis.num_layers, vis.num_heads
    v.projection_dim, v.projector_hidden_act, v.dtype = vlm.width, "gelu_fast", "float32"
    expert_hf = CONFIG_MAPPING["gemma"](
        head_dim=expert.head_dim,
        hidden_size=expert.width,
        intermediate_size=expert.mlp_dim,
        num_attention_heads=expert.num_heads,
        num_hidden_layers=expert.depth,
        num_key_value_heads=expert.num_kv_heads,
        vocab_size=cfg.vocab_size,
        hidden_activation="gelu_pytorch_tanh",
        dtype="float32",
        use_adarms=True,
        adarms_cond_dim=expert.width,
    )
    pwe = PaliGemmaWithExpertModel.__new__(PaliGemmaWithExpertModel)
    nn.Module.__init__(pwe)
    pwe.freeze_vision_encoder = False
    pwe.train_expert_only = False
    pwe.paligemma = PaliGemmaForConditionalGenerationWithPiGemma(config=vlm_hf)
    pwe.gemma_expert = PiGemmaForCausalLM(config=expert_hf)
    pwe.gemma_expert.model.embed_tokens = None
    pwe.to_bfloat16_for_selected_params("float32")

    model = PI05Pytorch.__new__(PI05Pytorch)
    nn.Module.__init__(model)
    model.config = PI05Config(
        chunk_size=cfg.chunk_size,
        n_action_steps=cfg.chunk_size,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
        image_resolution=(cfg.image_size, cfg.image_size),
        min_period=cfg.min_period,
        max_period=cfg.max_period,
    )
    model.rtc_processor = None
    model.paligemma_with_expert = pwe
    model.action_in_proj = nn.Linear(cfg.max_action_dim, expert.width)
    model.action_out_proj = nn.Linear(expert.width, cfg.max_action_dim)
    model.time_mlp_in = nn.Linear(expert.width, expert.width)
    model.time_mlp_out = nn.Linear(expert.width, expert.width)
    model.gradient_checkpointing_enabled = False
    return model
