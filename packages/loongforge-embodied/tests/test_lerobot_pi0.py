"""Pi0 equivalence with LeRobot's own implementation (lerobot.policies.pi0) on tiny configs."""

from __future__ import annotations

import json

import pytest
import torch

from embodied_helpers import policy_batch as make_batch
from lerobot_reference import (assert_exported_state_dict, assert_same_loss_and_gradients,
                               build_lerobot_pi0, build_lerobot_pi0_policy, lerobot_loss, perturb_norms)
from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.convert.lerobot_pi0 import from_lerobot_pi0, to_lerobot_pi0
from loongforge.embodied.policies import build_policy, policy_config
from loongforge.embodied.policies.flow_matching import euler_integrate
from loongforge.embodied.task import masked_flow_loss

IMAGE = 32


@pytest.fixture(scope="module")
def pair():
    cfg = policy_config("pi0", image_size=IMAGE)
    torch.manual_seed(0)
    ref = build_lerobot_pi0(cfg)
    perturb_norms(ref)
    ours = build_policy(cfg)
    ours.load_state_dict(from_lerobot_pi0(ref.state_dict()), strict=True)
    return cfg, ref, ours


def test_same_loss_and_gradients_as_lerobot(pair):
    cfg, ref, ours = pair
    our_loss = assert_same_loss_and_gradients(ref, ours, from_lerobot_pi0, *make_batch(cfg), rtol=1e-5, atol=1e-6)
    assert our_loss.shape == (3, cfg.chunk_size, cfg.max_action_dim)
    assert ours.state_proj.weight.grad.abs().max() > 0  # the state token is Pi0's own


def test_loss_is_lerobot_pi0policy_loss(pair):
    """LeRobot's ``PI0Policy.forward`` (image scaling, state/action padding, its own noise and
    Beta time draws, the mean over the real action dimensions) against the task's masked loss of
    our policy on the same batch, noise and time (LeRobot's draws replayed from the same seed)."""
    cfg, ref, ours = pair
    policy = build_lerobot_pi0_policy(cfg, cameras=2, state_dim=3, action_dim=5)
    policy.model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(4)
    b = 2
    images = [torch.rand(b, 3, IMAGE, IMAGE, generator=g) for _ in range(2)]  # LeRobot's [0, 1] frames
    state, actions = torch.randn(b, 3, generator=g), torch.randn(b, cfg.chunk_size, 5, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (b, 9), generator=g)
    token_mask = torch.arange(9)[None] < torch.tensor([[9], [5]])
    theirs = {"observation.images.cam0": images[0], "observation.images.cam1": images[1], "observation.state": state,
              "action": actions, "observation.language.tokens": tokens, "observation.language.attention_mask": token_mask}
    torch.manual_seed(11)
    with torch.no_grad():
        want, _ = policy.forward(theirs)
    torch.manual_seed(11)  # the same draws, by LeRobot's own samplers
    noise = policy.model.sample_noise((b, cfg.chunk_size, cfg.max_action_dim), "cpu")
    t = policy.model.sample_time(b, "cpu")
    pad = lambda x: torch.nn.functional.pad(x, (0, cfg.max_action_dim - x.shape[-1]))  # noqa: E731
    batch = {"images": torch.stack(images, 1) * 2 - 1, "image_mask": torch.ones(b, 2, dtype=torch.bool),
             "tokens": tokens, "token_mask": token_mask, "state": torch.nn.functional.pad(state, (0, cfg.max_state_dim - 3)),
             "actions": pad(actions), "action_is_pad": torch.zeros(b, cfg.chunk_size, dtype=torch.bool),
             "action_dim_mask": (torch.arange(cfg.max_action_dim) < 5).expand(b, -1)}
    with torch.no_grad():
        total, count = masked_flow_loss(batch, ours(batch, noise, t))
    assert count == b * cfg.chunk_size * 5
    torch.testing.assert_close(total / count, want, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_is_bitwise(pair):
    cfg, ref, ours = pair
    sd = ref.state_dict()
    assert_exported_state_dict(ref, ours, to_lerobot_pi0(ours.state_dict(), policy_prefix=False))
    saved = to_lerobot_pi0(ours.state_dict(), cfg)  # a saved PI0Policy prefixes every key with "model."
    assert all(k.startswith("model.") for k in saved)
    again = from_lerobot_pi0(saved)
    assert set(again) == set(ours.state_dict())
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())
    with pytest.raises(MappingError, match="bogus"):
        from_lerobot_pi0({**sd, "paligemma_with_expert.bogus.weight": torch.zeros(1)})
    with pytest.raises(MappingError, match="time_mlp_in.weight"):  # a Pi0.5 head is not Pi0's
        from_lerobot_pi0({**sd, "time_mlp_in.weight": torch.zeros(1)})
    with pytest.raises(MappingError, match=r"missing .*state_proj\.bias"):
        from_lerobot_pi0({k: v for k, v in sd.items() if k != "state_proj.bias"})
    with pytest.raises(MappingError, match="does not know: layers.0.expert.bogus"):
        to_lerobot_pi0({**ours.state_dict(), "layers.0.expert.bogus": torch.zeros(1)})


def test_lerobot_loads_our_export_and_gives_the_same_loss(pair):
    cfg, ref, ours = pair
    other = build_lerobot_pi0(cfg)
    other.load_state_dict(to_lerobot_pi0(ours.state_dict(), cfg, policy_prefix=False), strict=True)
    batch, noise, t = make_batch(cfg, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(lerobot_loss(other, batch, noise, t), ours(batch, noise, t), rtol=1e-5, atol=1e-6)


def test_cached_sampling_matches_full_recompute(pair):
    """The KV-cached sampler (state token recomputed per step, as LeRobot's ``denoise_step``
    does) against Euler on the full joint forward, which the loss test ties to LeRobot."""
    cfg, _, ours = pair
    batch, noise, _ = make_batch(cfg)
    ours.eval()
    cached = ours.sample_actions(batch, noise, num_steps=3)
    with torch.no_grad():
        full = euler_integrate(lambda x, t: ours.velocity(batch, x, t), noise, 3)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
    assert cached.abs().mean() > 0.1


def test_released_size_preset_has_lerobot_pi0_shapes():
    """``policy=pi0_base`` against LeRobot's own ``PI0Pytorch(PI0Config())`` on the meta device."""
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from lerobot.policies.pi0.modeling_pi0 import PI0Pytorch

    from loongforge.embodied.config import load_train_config

    cfg = load_train_config("train", ["model=pi0_base"]).model
    with torch.device("meta"):
        ref = PI0Pytorch(PI0Config(dtype="float32"))
        ours = build_policy(cfg)
    mapped = from_lerobot_pi0(ref.state_dict())
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert set(mapped) == set(shapes)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == shapes


def test_family_adapter_translates_lerobot_pi0_config(tmp_path):
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.pi0.configuration_pi0 import PI0Config

    from loongforge.core.config import to_dict
    from loongforge.embodied.config import load_train_config
    from loongforge.embodied.policies.pi0 import PI0_SPEC

    adapter = PI0_SPEC.hf_adapter
    cfg = policy_config("pi0", image_size=IMAGE)
    with torch.device("meta"):
        names = set(build_policy(cfg).state_dict())
    assert set(adapter.bind(cfg).lf_names) == names
    base = load_train_config("train", ["model=pi0_base"]).model
    PI0Config()._save_pretrained(tmp_path)  # LeRobot's own config.json of its released pi0
    assert to_dict(adapter.config_from_hf(json.loads((tmp_path / "config.json").read_text()))) == to_dict(base)
    (tmp_path / "config.json").write_text(json.dumps(adapter.config_to_hf(base)))
    theirs = PreTrainedConfig.from_pretrained(tmp_path)  # LeRobot reads what we write
    assert isinstance(theirs, PI0Config) and (theirs.chunk_size, theirs.tokenizer_max_length) == (50, 48)
    with pytest.raises(MappingError, match="type='pi05'; only pi0"):
        adapter.config_from_hf({**adapter.config_to_hf(base), "type": "pi05"})
