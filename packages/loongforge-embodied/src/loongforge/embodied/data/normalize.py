"""State/action normalisation from a LeRobot dataset's ``meta/stats.json``.

Modes follow LeRobot's ``NormalizationMode`` semantics: ``mean_std`` (x - mean) / (std + eps);
``min_max`` / ``quantiles`` / ``quantile10`` map [lo, hi] = [min, max] / [q01, q99] / [q10, q90]
linearly onto [-1, 1] (a zero-width range uses eps as its width); ``identity`` passes through.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

EPS = 1e-8
_BOUNDS = {"min_max": ("min", "max"), "quantiles": ("q01", "q99"), "quantile10": ("q10", "q90")}


class Normalizer:
    """Normalises named features with per-dimension statistics."""

    def __init__(self, stats: Mapping[str, Mapping[str, object]], modes: Mapping[str, str]):
        self.modes = dict(modes)
        self.params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, mode in self.modes.items():
            if mode == "identity":
                continue
            if key not in stats:
                raise KeyError(f"no statistics for feature {key!r} in the dataset stats (have: {sorted(stats)})")
            feature_stats = stats[key]
            needed = ("mean", "std") if mode == "mean_std" else _BOUNDS.get(mode)
            if needed is None:
                raise ValueError(f"feature {key!r}: unknown normalisation mode {mode!r}")
            missing = [s for s in needed if s not in feature_stats]
            if missing:
                raise KeyError(f"feature {key!r} normalised with {mode!r} needs stats {missing}; the dataset has {sorted(feature_stats)}")
            a, b = (torch.as_tensor(np.asarray(feature_stats[s], dtype=np.float32)).reshape(-1) for s in needed)
            self.params[key] = (a, b)

    def _affine(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(shift, scale) with normalised = (x - shift) / scale."""
        mode = self.modes.get(key, "identity")
        if mode == "identity":
            return None
        a, b = (t.to(device=x.device, dtype=torch.float32) for t in self.params[key])
        if mode == "mean_std":
            return a, b + EPS
        width = b - a
        width = torch.where(width == 0, torch.full_like(width, EPS), width)
        return a + width / 2, width / 2

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        affine = self._affine(key, x)
        if affine is None:
            return x.float()
        shift, scale = affine
        return (x.float() - shift) / scale

    def unnormalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        affine = self._affine(key, x)
        if affine is None:
            return x.float()
        shift, scale = affine
        return x.float() * scale + shift
