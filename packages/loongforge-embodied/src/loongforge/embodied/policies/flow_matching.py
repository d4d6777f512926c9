"""Flow matching on action chunks (the Pi0 convention, shared by every policy here).

Time ``t`` runs from 0 (data) to 1 (noise): ``x_t = t * noise + (1 - t) * actions``; the model
predicts the velocity ``u = dx_t/dt = noise - actions``; sampling integrates ``dx = v dt`` with
forward Euler from ``t = 1`` to ``t = 0`` in ``num_steps`` steps of ``-1/num_steps``.
Training times are ``Beta(alpha, beta) * scale + offset`` (or uniform on ``[offset, offset+scale]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch


def sample_time(
    batch: int,
    *,
    kind: str,
    alpha: float,
    beta: float,
    scale: float,
    offset: float,
    rng: np.random.Generator,
) -> torch.Tensor:
    """``[batch]`` float32 flow-matching times drawn from ``rng``."""
    if kind == "uniform":
        u = rng.uniform(0.0, 1.0, size=batch)
    elif kind == "beta":
        u = rng.beta(alpha, beta, size=batch)
    else:
        raise ValueError(f"time sampling {kind!r}: one of beta, uniform")
    return torch.from_numpy(u * scale + offset).to(torch.float32)


def draw_noise_and_time(seed: int, step: int, shape: tuple[int, ...], **time_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise ``[B, ...]`` and times ``[B]`` of global batch ``step``: a pure function of
    ``(seed, step)``, so any data-parallel split (and any resume) sees the same values; each rank
    slices its rows."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    t = sample_time(shape[0], rng=np.random.default_rng([seed, step]), **time_kwargs)
    return noise, t


def interpolate(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t`` for per-sample times ``t`` ``[B]``."""
    t = t.reshape(-1, *([1] * (actions.dim() - 1))).to(actions.dtype)
    return t * noise + (1 - t) * actions


def velocity_target(actions: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - actions


def euler_integrate(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Integrate ``velocity(x_t, t[B])`` from ``t = 1`` (``noise``) to ``t = 0``."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: must be >= 1")
    dt = -1.0 / num_steps
    x = noise
    for step in range(num_steps):
        t = torch.full((noise.shape[0],), 1.0 + step * dt, dtype=torch.float32, device=noise.device)
        x = x + dt * velocity(x, t)
    return x


def sinusoidal_embedding(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """``[B, dim]`` sin/cos features of scalar times with periods log-spaced in [min, max]."""
    if dim % 2:
        raise ValueError(f"sinusoidal embedding dimension {dim} must be even")
    dtype = torch.float64 if t.device.type in ("cpu", "cuda") else torch.float32
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t[:, None].to(dtype)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(t.dtype)
