"""LeRobot's own Pi0 / Pi0.5 modules (``lerobot.policies.pi0`` / ``pi05``) at a tiny size, for
equivalence tests.

LeRobot's constructors only build the released sizes: ``PI0Pytorch.__init__`` /
``PI05Pytorch.__init__`` look up the ``gemma_2b`` / ``gemma_300m`` variants and
``PaliGemmaWithExpertModel.__init__`` fixes the SigLIP-so400m vision tower (27 layers, width 1152,
projection 2048). Here the same LeRobot classes are assembled with tiny configs, setting exactly
the attributes those constructors set (see lerobot/policies/pi0/modeling_pi0.py and
pi05/modeling_pi05.py); every forward method that runs is LeRobot's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from lerobot.configs import FeatureType, PolicyFeature
from lerobot.policies.pi0 import modeling_pi0
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi05 import modeling_pi05
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi_gemma import PaliGemmaForConditionalGenerationWithPiGemma, PiGemmaForCausalLM
from lerobot.utils.constants import ACTION, OBS_IMAGES, OBS_STATE
from transformers.models.auto import CONFIG_MAPPING

from loongforge.embodied.config import PolicyConfig


def _paligemma_with_expert(module, cfg: PolicyConfig, expert_adarms: bool):
    """``module.PaliGemmaWithExpertModel`` (pi0's or pi05's) with tiny backbone and expert."""
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
        use_adarms=expert_adarms,
        adarms_cond_dim=expert.width if expert_adarms else None,
    )
    pwe = module.PaliGemmaWithExpertModel.__new__(module.PaliGemmaWithExpertModel)
    nn.Module.__init__(pwe)
    pwe.freeze_vision_encoder = False
    pwe.train_expert_only = False
    pwe.paligemma = PaliGemmaForConditionalGenerationWithPiGemma(config=vlm_hf)
    pwe.gemma_expert = PiGemmaForCausalLM(config=expert_hf)
    pwe.gemma_expert.model.embed_tokens = None
    pwe.to_bfloat16_for_selected_params("float32")
    return pwe


def _lerobot_config(config_class, cfg: PolicyConfig, **extra):
    return config_class(chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size, max_state_dim=cfg.max_state_dim,
                        max_action_dim=cfg.max_action_dim, image_resolution=(cfg.image_size, cfg.image_size),
                        min_period=cfg.min_period, max_period=cfg.max_period, **extra)


def _core(module_class, config, pwe, cfg: PolicyConfig):
    model = module_class.__new__(module_class)
    nn.Module.__init__(model)
    model.config = config
    model.rtc_processor = None
    model.paligemma_with_expert = pwe
    model.action_in_proj = nn.Linear(cfg.max_action_dim, cfg.expert.width)
    model.action_out_proj = nn.Linear(cfg.expert.width, cfg.max_action_dim)
    model.gradient_checkpointing_enabled = False
    return model


def build_lerobot_pi05(cfg: PolicyConfig) -> modeling_pi05.PI05Pytorch:
    model = _core(modeling_pi05.PI05Pytorch, _lerobot_config(PI05Config, cfg),
                  _paligemma_with_expert(modeling_pi05, cfg, expert_adarms=True), cfg)
    model.time_mlp_in = nn.Linear(cfg.expert.width, cfg.expert.width)
    model.time_mlp_out = nn.Linear(cfg.expert.width, cfg.expert.width)
    return model


def build_lerobot_pi0(cfg: PolicyConfig, config: PI0Config | None = None) -> modeling_pi0.PI0Pytorch:
    width = cfg.expert.width
    model = _core(modeling_pi0.PI0Pytorch, config or _lerobot_config(PI0Config, cfg),
                  _paligemma_with_expert(modeling_pi0, cfg, expert_adarms=False), cfg)
    model.state_proj = nn.Linear(cfg.max_state_dim, width)
    model.action_time_mlp_in = nn.Linear(2 * width, width)
    model.action_time_mlp_out = nn.Linear(width, width)
    return model


def build_lerobot_pi0_policy(cfg: PolicyConfig, cameras: int, state_dim: int, action_dim: int) -> modeling_pi0.PI0Policy:
    """LeRobot's ``PI0Policy`` (its preprocessing, padding, noise/time sampling and loss reduction)
    around a tiny ``PI0Pytorch``, for a dataset of ``cameras`` cameras and the given state/action
    sizes (``observation.images.camI``, ``observation.state``, ``action``)."""
    size = cfg.image_size
    config = _lerobot_config(
        PI0Config, cfg, device="cpu",
        input_features={**{f"{OBS_IMAGES}.cam{i}": PolicyFeature(FeatureType.VISUAL, (3, size, size)) for i in range(cameras)},
                        OBS_STATE: PolicyFeature(FeatureType.STATE, (state_dim,))},
        output_features={ACTION: PolicyFeature(FeatureType.ACTION, (action_dim,))})
    policy = modeling_pi0.PI0Policy.__new__(modeling_pi0.PI0Policy)
    nn.Module.__init__(policy)
    policy.config = config
    policy.rtc_processor = None
    policy.model = build_lerobot_pi0(cfg, config)
    policy.reset()
    return policy


def perturb_norms(model: nn.Module, scale: float = 0.2) -> None:
    """Random offsets on every norm parameter: zero-initialised norms (and adaRMS projections)
    would hide mistakes."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * scale)


def lerobot_loss(model, batch, noise, t):
    """LeRobot's per-element loss (``PI0Pytorch`` / ``PI05Pytorch.forward``) of one of our batches
    (cameras as lists; the state only for Pi0, Pi0.5 has it in the prompt)."""
    state = (batch["state"],) if isinstance(model, modeling_pi0.PI0Pytorch) else ()
    return model.forward(list(batch["images"].unbind(1)), list(batch["image_mask"].unbind(1)), batch["tokens"],
                         batch["token_mask"], *state, batch["actions"], noise, t)


TIED_LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"  # tied to the token embedding
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"  # never used by either policy


def assert_same_loss_and_gradients(ref, ours, from_lerobot, batch, noise, t, rtol: float, atol: float):
    """LeRobot's ``ref`` and our ``ours`` (its weights): the same per-element loss (``rtol``/``atol``)
    and, for the mean loss, the same gradient of every trainable parameter; the frozen ones get
    none from LeRobot either. Returns our loss."""
    ref.zero_grad(), ours.zero_grad()
    ref_loss = lerobot_loss(ref, batch, noise, t)
    our_loss = ours(batch, noise, t)
    torch.testing.assert_close(our_loss, ref_loss, rtol=rtol, atol=atol)
    ref_loss.mean().backward()
    our_loss.mean().backward()
    ref_grads = from_lerobot({k: p.grad for k, p in ref.named_parameters() if p.grad is not None}, partial=True)
    checked = 0
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
        else:  # frozen here because LeRobot's loss does not reach them either
            assert name not in ref_grads or ref_grads[name].abs().max() == 0, name
    assert checked > 50
    return our_loss


def assert_exported_state_dict(ref, ours, exported: dict) -> None:
    """Our export in LeRobot's names (no policy prefix) is LeRobot's state dict bit for bit, but for
    the expert's unused lm_head (zeros) and the tied lm_head (our token embedding)."""
    sd = ref.state_dict()
    assert set(exported) == set(sd)
    for key, value in sd.items():
        if key == EXPERT_LM_HEAD:
            assert exported[key].shape == value.shape and exported[key].abs().max() == 0
        elif key == TIED_LM_HEAD:
            assert torch.equal(exported[key], ours.prefix.embed_tokens.weight.detach())
        else:
            assert torch.equal(exported[key], value), key
