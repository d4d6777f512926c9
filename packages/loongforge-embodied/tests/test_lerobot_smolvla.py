"""SmolVLA equivalence with LeRobot's own implementation (lerobot.policies.smolvla) on tiny configs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from embodied_helpers import policy_batch as make_batch
from lerobot_reference import perturb_norms
from lerobot_smolvla_reference import build_lerobot_smolvla, build_lerobot_smolvla_policy, smolvla_loss
from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.convert.lerobot_layout import from_lerobot, to_lerobot
from loongforge.embodied.convert.lerobot_smolvla import LEROBOT_SMOLVLA_ADAPTER as ADAPTER
from loongforge.embodied.policies import build_policy, policy_config
from loongforge.embodied.policies.flow_matching import euler_integrate

# the whole VLM trains here, so every gradient is compared (LeRobot's default freezes it)
TRAIN_ALL = dict(train_expert_only=False, freeze_vision_encoder=False)


@pytest.fixture(scope="module")
def pair():
    cfg = policy_config("smolvla", **TRAIN_ALL)
    torch.manual_seed(0)
    ref = build_lerobot_smolvla(cfg)
    perturb_norms(ref)
    ours = build_policy(cfg)
    ours.load_state_dict(from_lerobot(ADAPTER, ref.state_dict()), strict=True)
    return cfg, ref, ours


def test_same_loss_and_gradients_as_lerobot(pair):
    """The per-element loss and every trainable parameter's gradient equal LeRobot's; what we
    freeze LeRobot freezes too (the VLM's last layer, final norm and lm_head)."""
    cfg, ref, ours = pair
    batch, noise, t = make_batch(cfg)
    ref.zero_grad(), ours.zero_grad()
    ref_loss, our_loss = smolvla_loss(ref, batch, noise, t), ours(batch, noise, t)
    torch.testing.assert_close(our_loss, ref_loss, rtol=1e-4, atol=1e-5)
    ref_loss.mean().backward()
    our_loss.mean().backward()
    ref_grads = from_lerobot(ADAPTER, {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}, partial=True)
    theirs_trainable = set(from_lerobot(ADAPTER, {k: p for k, p in ref.named_parameters() if p.requires_grad}, partial=True))
    ours_trainable = {name for name, p in ours.named_parameters() if p.requires_grad}
    assert ours_trainable == theirs_trainable
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert len(ours_trainable) > 80


def test_lerobot_default_freezes_the_vlm():
    """With LeRobot's defaults (train_expert_only, freeze_vision_encoder) the same parameters train."""
    cfg = policy_config("smolvla")
    ref, ours = build_lerobot_smolvla(cfg), build_policy(cfg)
    theirs = set(from_lerobot(ADAPTER, {k: p for k, p in ref.named_parameters() if p.requires_grad}, partial=True))
    assert theirs == {name for name, p in ours.named_parameters() if p.requires_grad}
    assert all(name.startswith(("layers.", "expert_norm", "state_proj", "action_")) and ".vlm." not in name for name in theirs)


def test_state_dict_round_trip_is_exact(pair):
    cfg, ref, ours = pair
    sd = ref.state_dict()
    bare = to_lerobot(ADAPTER, ours.state_dict(), policy_prefix=False)
    assert set(bare) == set(sd) and all(torch.equal(bare[k], v) for k, v in sd.items())
    saved = to_lerobot(ADAPTER, ours.state_dict(), cfg)  # a saved SmolVLAPolicy prefixes every key with "model."
    assert all(k.startswith("model.") for k in saved)
    back = from_lerobot(ADAPTER, saved)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items()) and set(back) == set(ours.state_dict())
    with pytest.raises(MappingError, match="bogus"):
        from_lerobot(ADAPTER, {**sd, "vlm_with_expert.bogus.weight": torch.zeros(1)})
    deeper = replace(cfg, vlm=replace(cfg.vlm, depth=6), expert=replace(cfg.expert, depth=6))
    with pytest.raises(MappingError, match=r"missing .*layers\.4\."):
        from_lerobot(ADAPTER, sd, deeper)


def test_lerobot_loads_our_export_and_gives_the_same_loss(pair):
    cfg, _, ours = pair
    other = build_lerobot_smolvla(cfg)
    other.load_state_dict(to_lerobot(ADAPTER, ours.state_dict(), cfg, policy_prefix=False), strict=True)
    batch, noise, t = make_batch(cfg, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(smolvla_loss(other, batch, noise, t), ours(batch, noise, t), rtol=1e-4, atol=1e-5)


def test_cached_sampling_matches_full_recompute(pair):
    """LeRobot's own sample_actions does not run against transformers 5.24 (its denoise step calls
    ``DynamicCache.crop`` with a positive length, which transformers now refuses), so the KV-cached
    sampler is checked against Euler on the full forward of both streams, which the loss test ties
    to LeRobot."""
    cfg, _, ours = pair
    batch, noise, _ = make_batch(cfg)
    ours.eval()
    cached = ours.sample_actions(batch, noise, num_steps=3)
    with torch.no_grad():
        full = euler_integrate(lambda x, t: ours.velocity(batch, x, t), noise, 3)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
    assert cached.abs().mean() > 0.1


def test_saved_lerobot_policy_imports_and_exports(pair, tmp_path):
    """LeRobot's own ``SmolVLAPolicy._save_pretrained`` (config.json + model.safetensors) converts to
    our names and config, and our export writes the same tensors back."""
    from safetensors.torch import load_file

    from loongforge.embodied.export import import_lerobot

    cfg, ref, _ = pair
    policy = build_lerobot_smolvla_policy(cfg)
    policy.model.load_state_dict(ref.state_dict())
    policy._save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["type"] == "smolvla"
    out = import_lerobot(tmp_path, tmp_path / "ours.safetensors")  # the directory: config.json says smolvla
    ours = load_file(str(out))
    assert set(load_file(str(import_lerobot(tmp_path / "model.safetensors", tmp_path / "b.safetensors")))) == set(ours)
    assert set(ours) == set(build_policy(cfg).state_dict())
    theirs = load_file(str(tmp_path / "model.safetensors"))
    back = to_lerobot(ADAPTER, ours, cfg)
    assert set(back) == set(theirs) and all(torch.equal(back[k], v) for k, v in theirs.items())
    # the tiny VLM is no hub checkpoint: its config.json names one LeRobot's SmolVLA cannot build here
    with pytest.raises(MappingError, match="vlm_model_name"):
        ADAPTER.config_from_hf({**raw, "vlm_model_name": "local/tiny"})


def test_config_translation_of_smolvla_base(tmp_path):
    """LeRobot's default ``SmolVLAConfig`` (smolvla_base: SmolVLM2-500M cut to 16 layers, a 0.75-wide
    expert, cross-attention every other layer) <-> ours, and LeRobot reads what we write."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    SmolVLAConfig()._save_pretrained(tmp_path)
    ours = ADAPTER.config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (ours.vlm.width, ours.vlm.depth, ours.expert.width, ours.expert.mlp_dim) == (960, 16, 720, 2048)
    assert (ours.self_attn_every_n_layers, ours.image_size, ours.chunk_size, ours.train_expert_only) == (2, 512, 50, True)
    (tmp_path / "config.json").write_text(json.dumps(ADAPTER.config_to_hf(ours)))
    theirs = PreTrainedConfig.from_pretrained(tmp_path)
    assert isinstance(theirs, SmolVLAConfig)
    assert (theirs.num_vlm_layers, theirs.expert_width_multiplier, tuple(theirs.resize_imgs_with_padding)) == (16, 0.75, (512, 512))
    with pytest.raises(MappingError, match="num_expert_layers=8"):
        ADAPTER.config_from_hf({**ADAPTER.config_to_hf(ours), "num_expert_layers": 8})
    with pytest.raises(MappingError, match=r"model\.vlm=.*builds only the VLMs"):
        ADAPTER.config_to_hf(policy_config("smolvla"))
