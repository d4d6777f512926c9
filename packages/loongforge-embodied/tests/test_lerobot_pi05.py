"""Pi0.5 equivalence with LeRobot's own implementation (lerobot.policies.pi05) on tiny configs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from embodied_helpers import policy_batch as make_batch
from lerobot_reference import (TIED_LM_HEAD, assert_exported_state_dict, assert_same_loss_and_gradients,
                               build_lerobot_pi05, lerobot_loss, perturb_norms)
from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.convert.lerobot_pi05 import from_lerobot_pi05, to_lerobot_pi05
from loongforge.embodied.policies.flow_matching import euler_integrate
from loongforge.embodied.policies import build_policy, policy_config

IMAGE = 32


@pytest.fixture(scope="module")
def pair():
    cfg = policy_config("pi05", image_size=IMAGE)
    torch.manual_seed(0)
    ref = build_lerobot_pi05(cfg)
    perturb_norms(ref)
    ours = build_policy(cfg)
    ours.load_state_dict(from_lerobot_pi05(ref.state_dict()), strict=True)
    return cfg, ref, ours


def test_same_loss_and_gradients_as_lerobot(pair):
    cfg, ref, ours = pair
    assert_same_loss_and_gradients(ref, ours, from_lerobot_pi05, *make_batch(cfg), rtol=1e-4, atol=1e-5)


def test_state_dict_round_trip(pair):
    _, ref, ours = pair
    sd = ref.state_dict()
    assert_exported_state_dict(ref, ours, to_lerobot_pi05(ours.state_dict(), policy_prefix=False))
    saved = to_lerobot_pi05(ours.state_dict())  # a saved PI05Policy prefixes every key with "model."
    assert all(k.startswith("model.") for k in saved)
    assert set(from_lerobot_pi05(saved)) == set(ours.state_dict())
    # a checkpoint holding only the tied lm_head (openpi exports) still provides the embedding
    only_lm_head = {k: v for k, v in sd.items() if not k.endswith("language_model.embed_tokens.weight")}
    assert torch.equal(from_lerobot_pi05(only_lm_head)["prefix.embed_tokens.weight"], sd[TIED_LM_HEAD])
    with pytest.raises(MappingError, match="bogus"):
        from_lerobot_pi05({**sd, "paligemma_with_expert.bogus.weight": torch.zeros(1)})


def test_lerobot_loads_our_export_and_gives_the_same_loss(pair):
    cfg, ref, ours = pair
    other = build_lerobot_pi05(cfg)
    other.load_state_dict(to_lerobot_pi05(ours.state_dict(), cfg, policy_prefix=False), strict=True)
    batch, noise, t = make_batch(cfg, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(lerobot_loss(other, batch, noise, t), ours(batch, noise, t), rtol=1e-4, atol=1e-5)


def test_missing_and_mismatched_tensors_are_named(pair):
    cfg, ref, ours = pair
    sd = ref.state_dict()
    norm = "paligemma_with_expert.paligemma.model.language_model.norm.weight"
    with pytest.raises(MappingError, match=r"missing 1 tensor.*language_model\.norm\.weight"):
        from_lerobot_pi05({k: v for k, v in sd.items() if k != norm})
    with pytest.raises(MappingError, match=r"missing .*language_model\.layers\.1\."):  # a gap in the layers
        from_lerobot_pi05({k: v for k, v in sd.items() if ".language_model.layers.1." not in k})
    deeper = replace(cfg, vlm=replace(cfg.vlm, depth=3), expert=replace(cfg.expert, depth=3))
    with pytest.raises(MappingError, match=r"missing .*layers\.2\."):  # checked against the configured policy
        from_lerobot_pi05(sd, deeper)
    with pytest.raises(MappingError, match="does not know: layers.0.vlm.bogus"):
        to_lerobot_pi05({**ours.state_dict(), "layers.0.vlm.bogus": torch.zeros(1)})


def test_cached_sampling_matches_full_recompute(pair):
    """LeRobot's own sample_actions does not run against transformers 5.24 (its PiGemmaModel passes
    cache_position to create_causal_mask), so the KV-cached sampler is checked against Euler on the
    full joint forward, which the loss test ties to LeRobot."""
    cfg, _, ours = pair
    batch, noise, _ = make_batch(cfg)
    ours.eval()
    cached = ours.sample_actions(batch, noise, num_steps=3)
    with torch.no_grad():
        full = euler_integrate(lambda x, t: ours.velocity(batch, x, t), noise, 3)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
    assert cached.abs().mean() > 0.1


def test_released_size_preset_has_lerobot_pi05_shapes():
    """``policy=pi05_base`` against LeRobot's own ``PI05Pytorch(PI05Config())`` (gemma_2b +
    gemma_300m), both built on the meta device: every released tensor maps onto a tensor of ours of
    the same shape, so LeRobot's pi05 checkpoints load with ``policy.pretrained_format=lerobot``."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    from loongforge.embodied.config import load_train_config

    cfg = load_train_config("train", ["model=pi05_base"]).model
    with torch.device("meta"):
        ref = PI05Pytorch(PI05Config(dtype="float32"))
        ours = build_policy(cfg)
    mapped = from_lerobot_pi05({k: v for k, v in ref.state_dict().items()})
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert set(mapped) == set(shapes)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == shapes
    assert sum(v.numel() for v in ours.state_dict().values()) > 3.3e9


def test_family_adapter_is_the_lerobot_table(tmp_path):
    """``PI05_SPEC.hf_adapter`` binds the same table to a policy config and translates LeRobot's own
    ``config.json`` (its released sizes) to and from ``Pi05Config``; it names no transformers
    architecture, so ``hf_to_lf`` of an HF directory never picks the pi05 family."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    from loongforge.core.config import to_dict
    from loongforge.core.hf_mapping import family_for_architectures
    from loongforge.embodied.config import load_train_config
    from loongforge.embodied.policies.pi05 import PI05_SPEC

    adapter = PI05_SPEC.hf_adapter
    assert adapter.architectures == ()
    with pytest.raises(MappingError, match="not supported by any installed model family"):
        family_for_architectures(["PI05Policy", "pi05"])
    cfg = policy_config("pi05", image_size=IMAGE)
    with torch.device("meta"):
        names = set(build_policy(cfg).state_dict())
    assert set(adapter.bind(cfg).lf_names) == names

    base = load_train_config("train", ["model=pi05_base"]).model
    PI05Config()._save_pretrained(tmp_path)  # LeRobot's own config.json of its released pi05
    released = adapter.config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert to_dict(released) == to_dict(base)
    (tmp_path / "config.json").write_text(json.dumps(adapter.config_to_hf(base)))
    theirs = PreTrainedConfig.from_pretrained(tmp_path)  # LeRobot reads what we write
    assert isinstance(theirs, PI05Config) and (theirs.paligemma_variant, theirs.action_expert_variant) == ("gemma_2b", "gemma_300m")
    assert (theirs.chunk_size, theirs.max_action_dim, tuple(theirs.image_resolution)) == (50, 32, (224, 224))
    with pytest.raises(MappingError, match=r"policy\.vlm=.*only the Gemma variants"):
        adapter.config_to_hf(cfg)
    with pytest.raises(MappingError, match="paligemma_variant='gemma_7b'"):
        adapter.config_from_hf({**adapter.config_to_hf(base), "paligemma_variant": "gemma_7b"})
