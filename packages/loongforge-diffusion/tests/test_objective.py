"""Flow-matching math and timestep sampling against diffusers; packed loss == unpacked loss."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.training_utils import compute_density_for_timestep_sampling

from loongforge.diffusion.model import WanConfig, WanDiT
from loongforge.diffusion.objective import (
    ObjectiveConfig,
    TimestepSampler,
    noisy_and_target,
    pick_expert,
    token_weights,
    weighted_squared_error,
)
from loongforge.diffusion.packing import num_tokens, pack, pack_targets


@pytest.mark.parametrize("weighting", ["logit_normal", "uniform"])
def test_timesteps_follow_the_diffusers_recipe(weighting):
    cfg = ObjectiveConfig(shift=3.0, weighting=weighting, logit_mean=0.3, logit_std=1.2)
    ours = TimestepSampler(cfg)
    sigmas, timesteps = ours.sample(4096, torch.Generator().manual_seed(5))

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = compute_density_for_timestep_sampling(weighting, 4096, logit_mean=0.3, logit_std=1.2,
                                              generator=torch.Generator().manual_seed(5))
    idx = (u * 1000).long()
    torch.testing.assert_close(sigmas, scheduler.sigmas[idx].float())
    torch.testing.assert_close(timesteps, scheduler.timesteps[idx].float())
    # the shifted table itself: sigma' = shift*s / (1 + (shift-1)*s) of s = 1 ... 1/1000
    s = torch.linspace(1.0, 1e-3, 1000)
    torch.testing.assert_close(ours.sigmas, 3 * s / (1 + 2 * s))


def test_noisy_input_and_target_match_scale_noise():
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=2.0)
    sampler = TimestepSampler(ObjectiveConfig(shift=2.0))
    x0, noise = torch.randn(1, 4, 3, 4, 4), torch.randn(1, 4, 3, 4, 4)
    sigma, t = sampler.sample(1, torch.Generator().manual_seed(1))
    xt, target = noisy_and_target(x0, noise, sigma.item())
    torch.testing.assert_close(xt, scheduler.scale_noise(x0, t, noise))
    torch.testing.assert_close(target, noise - x0)


@pytest.mark.parametrize("weighting", ["logit_normal", "uniform"])
def test_expert_ranges_truncate_the_same_density(weighting):
    """Sampling each expert's side of the boundary with probability equal to its mass gives the
    untruncated distribution; each side stays on its side."""
    sampler = TimestepSampler(ObjectiveConfig(shift=5.0, weighting=weighting, logit_mean=-0.2))
    boundary = 875.0
    high, low = sampler.index_range(boundary, 0), sampler.index_range(boundary, 1)
    assert high[1] == low[0] and high[0] == 0 and low[1] == 1000
    n = 40000
    _, t_all = sampler.sample(n, torch.Generator().manual_seed(0))
    p_high = float((t_all >= boundary).double().mean())
    assert abs(sampler.mass(high) - p_high) < 0.01
    assert math.isclose(sampler.mass(high) + sampler.mass(low), 1.0, rel_tol=1e-9)
    _, t_high = sampler.sample(n, torch.Generator().manual_seed(1), high)
    _, t_low = sampler.sample(n, torch.Generator().manual_seed(2), low)
    assert bool((t_high >= boundary).all()) and bool((t_low < boundary).all())
    for q in (0.1, 0.5, 0.9):
        ref_high = torch.quantile(t_all[t_all >= boundary], q)
        ref_low = torch.quantile(t_all[t_all < boundary], q)
        assert abs(float(torch.quantile(t_high, q) - ref_high)) < 3.0
        assert abs(float(torch.quantile(t_low, q) - ref_low)) < 12.0


def test_expert_choice_follows_the_density_mass():
    sampler = TimestepSampler(ObjectiveConfig(shift=5.0))
    ranges = {"transformer": sampler.index_range(875.0, 0), "transformer_2": sampler.index_range(875.0, 1)}
    picks = [pick_expert(sampler, ranges, torch.Generator().manual_seed(i)) for i in range(4000)]
    share = picks.count("transformer") / len(picks)
    assert 0.2 < sampler.mass(ranges["transformer"]) < 0.8
    assert abs(share - sampler.mass(ranges["transformer"])) < 0.03


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_packed_loss_and_gradients_equal_unpacked(reduction):
    """One packed forward over mixed sizes gives the loss and gradients of running diffusers'
    module on each sample separately."""
    cfg = WanConfig()
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs())
    ours = WanDiT(cfg)
    ours.load_state_dict(ref.state_dict())
    shapes = [(4, 3, 8, 6), (4, 1, 4, 4), (4, 2, 6, 10), (4, 1, 10, 8)]
    x0 = [torch.randn(s) for s in shapes]
    noise = [torch.randn(s) for s in shapes]
    sigmas, timesteps = TimestepSampler(ObjectiveConfig()).sample(len(shapes), torch.Generator().manual_seed(3))
    text = torch.randn(len(shapes), cfg.text_len, cfg.text_dim)
    pairs = [noisy_and_target(a, b, s.item()) for a, b, s in zip(x0, noise, sigmas)]
    features = cfg.out_channels * cfg.patch_volume
    tokens = [num_tokens(s, cfg.patch_size) for s in shapes]

    batch = pack([p[0] for p in pairs], timesteps, text, cfg.patch_size, pad_to_multiple=8)
    target = pack_targets([p[1] for p in pairs], cfg.patch_size, batch.num_pad)
    weights = token_weights(tokens, batch.num_pad, reduction, features)
    packed = weighted_squared_error(ours(batch), target, weights) / (weights.sum() * features)  # loss sum / count
    packed.backward()

    per_sample = []
    for i, (xt, tgt) in enumerate(pairs):
        pred = ref(xt[None], timesteps[i : i + 1], text[i : i + 1], return_dict=False)[0][0]
        per_sample.append(((pred - tgt) ** 2).sum() if reduction == "token" else ((pred - tgt) ** 2).mean())
    unpacked = sum(per_sample) / (sum(tokens) * features if reduction == "token" else len(shapes))
    unpacked.backward()

    torch.testing.assert_close(packed, unpacked.double().float(), atol=1e-6, rtol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
