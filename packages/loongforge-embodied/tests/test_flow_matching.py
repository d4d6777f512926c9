"""Flow-matching math against hand-computed references."""

from __future__ import annotations

import math

import numpy as np
import torch

from loongforge.embodied.policies.flow_matching import (
    draw_noise_and_time,
    euler_integrate,
    interpolate,
    sample_time,
    sinusoidal_embedding,
    velocity_target,
)
from loongforge.embodied.policies import build_policy, policy_config


def test_interpolation_and_velocity_by_hand():
    actions = torch.tensor([[[1.0, -2.0]], [[0.5, 4.0]]])
    noise = torch.tensor([[[3.0, 0.0]], [[-1.0, 2.0]]])
    t = torch.tensor([0.25, 0.9])
    want = torch.tensor([[[0.25 * 3 + 0.75 * 1, 0.75 * -2]], [[0.9 * -1 + 0.1 * 0.5, 0.9 * 2 + 0.1 * 4]]])
    torch.testing.assert_close(interpolate(actions, noise, t), want)
    torch.testing.assert_close(velocity_target(actions, noise), torch.tensor([[[2.0, 2.0]], [[-1.5, -2.0]]]))
    # d/dt of x_t is the target velocity (finite difference)
    eps = 1e-3
    fd = (interpolate(actions, noise, t + eps) - interpolate(actions, noise, t - eps)) / (2 * eps)
    torch.testing.assert_close(fd, velocity_target(actions, noise), atol=1e-3, rtol=0)


def test_euler_with_the_exact_field_recovers_the_actions():
    g = torch.Generator().manual_seed(0)
    actions, noise = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    # along x_t = t*noise + (1-t)*a the velocity is (x_t - a) / t; Euler on it is exact step by step
    seen = []

    def field(x, t):
        seen.append(float(t[0]))
        return (x - actions) / t[:, None, None]

    out = euler_integrate(field, noise, 5)
    torch.testing.assert_close(out, actions, atol=1e-5, rtol=0)
    np.testing.assert_allclose(seen, [1.0, 0.8, 0.6, 0.4, 0.2], atol=1e-7)
    # one step with a constant field: x_0 = noise - v
    torch.testing.assert_close(euler_integrate(lambda x, t: torch.ones_like(x), noise, 1), noise - 1)


def test_time_sampling_and_embedding():
    kw = dict(kind="beta", alpha=1.5, beta=1.0, scale=0.999, offset=0.001)
    t = sample_time(20000, rng=np.random.default_rng(0), **kw)
    assert t.dtype == torch.float32 and float(t.min()) >= 0.001 and float(t.max()) <= 1.0
    # Beta(1.5, 1) has mean 0.6 and CDF x^1.5
    assert abs(float(t.mean()) - (0.6 * 0.999 + 0.001)) < 0.01
    assert abs(float((t < 0.5).float().mean()) - ((0.5 - 0.001) / 0.999) ** 1.5) < 0.01
    u = sample_time(5, rng=np.random.default_rng(1), kind="uniform", alpha=0, beta=0, scale=0.5, offset=0.25)
    np.testing.assert_allclose(u.numpy(), np.random.default_rng(1).uniform(size=5) * 0.5 + 0.25, rtol=1e-6)
    n1, t1 = draw_noise_and_time(7, 3, (4, 2, 2), **kw)
    n2, t2 = draw_noise_and_time(7, 3, (4, 2, 2), **kw)
    assert torch.equal(n1, n2) and torch.equal(t1, t2)
    assert not torch.equal(n1, draw_noise_and_time(7, 4, (4, 2, 2), **kw)[0])
    emb = sinusoidal_embedding(torch.tensor([0.375]), 6, min_period=4e-3, max_period=4.0)
    periods = [4e-3 * (4.0 / 4e-3) ** f for f in (0.0, 0.5, 1.0)]
    want = [math.sin(2 * math.pi * 0.375 / p) for p in periods] + [math.cos(2 * math.pi * 0.375 / p) for p in periods]
    np.testing.assert_allclose(emb[0].numpy(), want, rtol=1e-5, atol=1e-6)


def test_policy_loss_is_squared_velocity_error():
    """The policy's per-element loss is (noise - actions - v(x_t, t))^2 with x_t built by hand."""
    for name in ("pi0", "pi05", "pi05_dit_head"):
        torch.manual_seed(0)
        cfg = policy_config(name, chunk_size=4, max_action_dim=3, max_state_dim=3, num_cameras=1, image_size=16)
        policy = build_policy(cfg).eval()
        b = 2
        batch = {
            "images": torch.rand(b, 1, 3, 16, 16) * 2 - 1,
            "image_mask": torch.ones(b, 1, dtype=torch.bool),
            "tokens": torch.randint(4, 200, (b, 6)),
            "token_mask": torch.ones(b, 6, dtype=torch.bool),
            "state": torch.randn(b, 3),
            "actions": torch.randn(b, 4, 3),
        }
        noise, t = torch.randn(b, 4, 3), torch.tensor([0.2, 0.7])
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * batch["actions"]
        with torch.no_grad():
            loss = policy(batch, noise, t)
            if name != "pi05_dit_head":
                v = policy.velocity(batch, x_t, t)
            else:
                feats, pad = policy.features(batch)
                v = policy.head(feats, pad, batch["state"], x_t, t)
        torch.testing.assert_close(loss, (noise - batch["actions"] - v) ** 2)
