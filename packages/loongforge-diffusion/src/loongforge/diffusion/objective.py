"""Rectified-flow (flow-matching) objective with diffusers' timestep sampling.

Training timesteps follow the diffusers recipe for ``FlowMatchEulerDiscreteScheduler`` models
(SD3/Wan training scripts): draw ``u`` from a density on [0, 1) (``logit_normal``: sigmoid of
N(mean, std); ``uniform``), take index ``floor(u * num_train_timesteps)`` into the scheduler's
table, whose sigmas are already shifted (``shift * s / (1 + (shift - 1) * s)``). The noisy latent
is ``x_t = (1 - sigma) * x_0 + sigma * noise`` (the scheduler's ``scale_noise``), the model sees
timestep ``sigma * num_train_timesteps`` and regresses the velocity ``noise - x_0``.

For Wan 2.2's two experts a step trains one expert: its index range is the part of the table on
its side of the boundary, and timesteps are drawn from the same density restricted to that range
(exact inverse-CDF truncation). Choosing the expert with probability equal to the density's mass
on its side reproduces the untruncated distribution over (expert, timestep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ObjectiveConfig:
    num_train_timesteps: int = 1000  # discrete timesteps of the flow-matching schedule
    shift: float = 3.0  # timestep shift of the schedule (> 1 moves samples toward high noise)
    weighting: str = "logit_normal"  # logit_normal | uniform
    logit_mean: float = 0.0  # mean of the logit-normal timestep density (weighting=logit_normal)
    logit_std: float = 1.0  # standard deviation of the logit-normal timestep density
    loss_reduction: str = "token"  # token: every latent element weighs the same; sample: every sample
    text_dropout: float = 0.0  # probability of training a sample with an all-zero prompt (for CFG)

    def __post_init__(self):
        if self.num_train_timesteps < 2:
            raise ValueError(f"objective.num_train_timesteps={self.num_train_timesteps}: must be >= 2")
        if self.shift <= 0:
            raise ValueError(f"objective.shift={self.shift}: must be > 0")
        if self.weighting not in ("logit_normal", "uniform"):
            raise ValueError(f"objective.weighting={self.weighting!r}: one of logit_normal, uniform")
        if self.logit_std <= 0:
            raise ValueError(f"objective.logit_std={self.logit_std}: must be > 0")
        if self.loss_reduction not in ("token", "sample"):
            raise ValueError(f"objective.loss_reduction={self.loss_reduction!r}: one of token, sample")
        if not 0.0 <= self.text_dropout < 1.0:
            raise ValueError(f"objective.text_dropout={self.text_dropout}: must be in [0, 1)")


class TimestepSampler:
    def __init__(self, cfg: ObjectiveConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.cfg = cfg
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps, shift=cfg.shift)
        self.sigmas = scheduler.sigmas.clone().float()  # [N], descending from 1
        self.timesteps = scheduler.timesteps.clone().float()  # sigmas * N

    @property
    def size(self) -> int:
        return self.sigmas.numel()

    def index_range(self, boundary_timestep: float | None, expert: int) -> tuple[int, int]:
        """Table indices ``[a, b)`` of expert 0 (``t >= boundary``) or 1 (``t < boundary``)."""
        if boundary_timestep is None:
            return 0, self.size
        k = int((self.timesteps >= boundary_timestep).sum())
        return (0, k) if expert == 0 else (k, self.size)

    def _cdf(self, u: float) -> float:
        """P(U < u) under the density."""
        if self.cfg.weighting == "uniform":
            return u
        if u <= 0.0:
            return 0.0
        if u >= 1.0:
            return 1.0
        z = (math.log(u / (1 - u)) - self.cfg.logit_mean) / self.cfg.logit_std
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def mass(self, index_range: tuple[int, int]) -> float:
        a, b = index_range
        return self._cdf(b / self.size) - self._cdf(a / self.size)

    def sample_u(self, n: int, generator: torch.Generator, index_range: tuple[int, int] | None = None) -> torch.Tensor:
        cfg = self.cfg
        if index_range is None or index_range == (0, self.size):
            if cfg.weighting == "logit_normal":
                return torch.sigmoid(torch.normal(cfg.logit_mean, cfg.logit_std, size=(n,), generator=generator))
            return torch.rand(n, generator=generator)
        a, b = index_range
        lo, hi = self._cdf(a / self.size), self._cdf(b / self.size)
        p = lo + (hi - lo) * torch.rand(n, generator=generator, dtype=torch.float64)
        if cfg.weighting == "uniform":
            u = p
        else:
            u = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.special.ndtri(p))
        # keep the index inside [a, b) against rounding at the ends
        return u.clamp(a / self.size, (b - 0.5) / self.size).float()

    def sample(
        self, n: int, generator: torch.Generator, index_range: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas, timesteps)`` of ``n`` training samples."""
        u = self.sample_u(n, generator, index_range)
        idx = (u * self.size).long().clamp(0, self.size - 1)
        return self.sigmas[idx], self.timesteps[idx]


def pick_expert(sampler: TimestepSampler, ranges: dict[str, tuple[int, int]], generator: torch.Generator) -> str:
    """One of two experts (``ranges``: high-noise first), with probability its density mass."""
    (high, high_range), (low, _) = ranges.items()
    return high if torch.rand(1, generator=generator).item() < sampler.mass(high_range) else low


def noisy_and_target(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, velocity target)`` of one sample."""
    return (1.0 - sigma) * x0 + sigma * noise, noise - x0


def token_weights(token_counts: list[int], num_pad: int, reduction: str, features: int,
                  given: list[int] | None = None) -> torch.Tensor:
    """Per-token loss weights ``w`` of a pack (padding weighs 0): the pack's loss sum is
    ``sum_t w_t * sum_f (pred - target)^2`` and its count ``features * sum_t w_t``, so that summed
    over every pack of the global batch their ratio is the mean over latent elements (``token``)
    or the mean over samples of each sample's mean (``sample``: ``w_t = 1 / (n * features)`` for the
    ``n`` tokens of a sample, whose count then adds up to 1). ``given``: per sample, how many of
    its leading tokens are given rather than denoised (TI2V's clean first frame); they weigh 0."""
    rows = []
    for n, skip in zip(token_counts, given or [0] * len(token_counts)):
        loss_tokens = n - skip
        value = 1.0 if reduction == "token" else 1.0 / (max(loss_tokens, 1) * features)
        rows += [torch.zeros(skip), torch.full((loss_tokens,), value)]
    if num_pad:
        rows.append(torch.zeros(num_pad))
    return torch.cat(rows)


def weighted_squared_error(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t w_t * sum_f (pred - target)^2`` in fp32."""
    return ((pred.float() - target.float()).pow(2).sum(-1) * weights).sum()
