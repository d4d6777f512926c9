"""GR00T N1.7's action head equal to LeRobot's ``GR00TN17ActionHead`` on the same weights (tiny config)."""

from __future__ import annotations

import json

import pytest
import torch

from embodied_helpers import policy_batch as make_batch
from lerobot_groot_reference import build_lerobot_groot_head, lerobot_head_loss
from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.convert.lerobot_groot import LEROBOT_GROOT_ADAPTER as ADAPTER
from loongforge.embodied.convert.lerobot_layout import from_lerobot, to_lerobot
from loongforge.embodied.policies import build_policy, policy_config

HEAD = "action_head."


def _perturb(module):
    """Random offsets on every parameter: LayerNorm ones and zero biases would hide mistakes."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.fixture(scope="module")
def pair():
    cfg = policy_config("groot_n1_7", head=policy_config("groot_n1_7").head.__class__(embodiment_id=2, max_num_embodiments=4,
                                                                                        max_seq_len=64))
    torch.manual_seed(0)
    ref = build_lerobot_groot_head(cfg)
    _perturb(ref)
    ours = build_policy(cfg)
    head = from_lerobot(ADAPTER, {"_groot_model.action_head." + k: v for k, v in ref.state_dict().items()})
    missing, unexpected = ours.load_state_dict(head, strict=False)
    assert not unexpected and all(not k.startswith(HEAD) for k in missing)
    return cfg, ref, ours


def test_same_loss_and_gradients_as_lerobot(pair):
    """On the same backbone features, state and actions, with LeRobot's own noise and time draws
    replayed (its forward draws ``randn`` then ``Beta``), the per-element loss and the gradient of
    every head parameter equal LeRobot's."""
    cfg, ref, ours = pair
    ref.eval(), ours.eval()  # dropout off (the tiny config has none; LeRobot's frozen-module eval switch aside)
    batch, _, _ = make_batch(cfg)
    with torch.no_grad():
        feats, pad, image = ours.features(batch)
    feats = feats.detach().requires_grad_(True)
    actions = batch["actions"]
    torch.manual_seed(7)
    ref.zero_grad(), ours.zero_grad()
    theirs = lerobot_head_loss(ref, feats, image, pad, batch["state"], actions, cfg.head.embodiment_id)
    torch.manual_seed(7)  # replay LeRobot's draws: noise, then tau = (1 - Beta(1.5, 1)) * 0.999
    noise = torch.randn(actions.shape)
    tau = (1 - torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0)).sample([actions.shape[0]])) * 0.999
    f, s = ours.action_head.encode(feats, batch["state"])
    x = (1 - tau)[:, None, None] * noise + tau[:, None, None] * actions
    v = ours.action_head.velocity(f, s, x, ours.action_head.buckets(tau), image, pad)
    mine = (v - (actions - noise)) ** 2
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    theirs.mean().backward()
    mine.mean().backward()
    ref_grads = from_lerobot(ADAPTER, {"action_head." + k: p.grad for k, p in ref.named_parameters() if p.grad is not None},
                             partial=True)
    checked = 0
    for name, p in ours.named_parameters():
        if name.startswith(HEAD) and p.grad is not None:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
    assert checked > 60 and set(ref_grads) <= {n for n, p in ours.named_parameters() if p.grad is not None}


def test_policy_loss_is_the_head_loss_in_our_time(pair):
    """``GrootN17Policy.forward`` at our ``t`` is the head's loss at GR00T's ``tau = 1 - t``."""
    cfg, _, ours = pair
    ours.eval()
    batch, noise, t = make_batch(cfg)
    with torch.no_grad():
        loss = ours(batch, noise, t)
        feats, pad, image = ours.features(batch)
        f, s = ours.action_head.encode(feats, batch["state"])
        tau = 1 - t
        x = (1 - tau)[:, None, None] * noise + tau[:, None, None] * batch["actions"]
        v = ours.action_head.velocity(f, s, x, ours.action_head.buckets(tau), image, pad)
    torch.testing.assert_close(loss, (v - (batch["actions"] - noise)) ** 2, rtol=1e-5, atol=1e-6)


def test_sampling_equals_lerobot_get_action(pair):
    """Our Euler sampler against LeRobot's ``get_action`` (its noise replayed)."""
    from transformers.feature_extraction_utils import BatchFeature

    cfg, ref, ours = pair
    ref.eval(), ours.eval()
    batch, _, _ = make_batch(cfg)
    with torch.no_grad():
        feats, pad, image = ours.features(batch)
        backbone = BatchFeature(data={"backbone_features": feats, "backbone_attention_mask": pad, "image_mask": image})
        inputs = BatchFeature(data={"state": batch["state"][:, None, :],
                                    "embodiment_id": torch.full((3,), cfg.head.embodiment_id, dtype=torch.long)})
        torch.manual_seed(3)
        theirs = ref.get_action(backbone, inputs)["action_pred"]
        torch.manual_seed(3)
        noise = torch.randn(theirs.shape)
        mine = ours.sample_actions(batch, noise)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_head_round_trip_and_config(pair, tmp_path):
    cfg, ref, ours = pair
    saved = to_lerobot(ADAPTER, ours.state_dict(), cfg)  # the head alone, as a GrootPolicy names it
    assert all(k.startswith("_groot_model.action_head.") for k in saved)
    assert set(saved) == {"_groot_model.action_head." + k for k in ref.state_dict()}
    assert all(torch.equal(saved["_groot_model.action_head." + k], v) for k, v in ref.state_dict().items())
    # a whole GrootPolicy file: the backbone's tensors are GR00T's own and stay out
    whole = {**saved, "_groot_model.backbone.model.lm_head.weight": torch.zeros(2, 2)}
    back = from_lerobot(ADAPTER, whole)
    head = {k: v for k, v in ours.state_dict().items() if k.startswith(HEAD)}
    assert set(back) == set(head) and all(torch.equal(back[k], v) for k, v in head.items())
    with pytest.raises(MappingError, match="bogus"):
        from_lerobot(ADAPTER, {**saved, "_groot_model.action_head.bogus.weight": torch.zeros(1)})
    # LeRobot's released N1.7 head config round-trips through ours
    from lerobot.policies.groot.groot_n1_7 import GR00T_N1_7_DEFAULTS

    released = ADAPTER.config_from_hf(json.loads(json.dumps(GR00T_N1_7_DEFAULTS)))
    assert (released.head.dit_layers, released.head.input_embedding_dim, released.chunk_size) == (32, 1536, 40)
    again = ADAPTER.config_to_hf(released)
    assert all(again[k] == GR00T_N1_7_DEFAULTS[k] for k in ("hidden_size", "input_embedding_dim", "max_seq_len"))
    with pytest.raises(MappingError, match="use_alternate_vl_dit=False"):
        ADAPTER.config_from_hf({**GR00T_N1_7_DEFAULTS, "use_alternate_vl_dit": False})


def test_a_lerobot_file_cannot_start_the_whole_policy(pair, tmp_path):
    """``model.pretrained_format=lerobot`` starts a whole policy; GR00T's layout covers the head only,
    so it is refused naming a tensor outside it."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from loongforge.embodied.task import read_pretrained

    cfg, _, ours = pair
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in to_lerobot(ADAPTER, ours.state_dict(), cfg).items()}, str(path))
    with pytest.raises(ValueError, match="covers only part of the policy.*prefix"):
        read_pretrained(replace(cfg, pretrained=str(path), pretrained_format="lerobot"))
