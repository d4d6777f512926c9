"""Evaluation hooks. ``offline_mse`` (built in) samples action chunks on the held-out episodes
and reports their mean squared error against the recorded actions; simulators plug in as other
hooks, registered under the ``loongforge.embodied.eval_hooks`` entry-point group::

    [project.entry-points."loongforge.embodied.eval_hooks"]
    my_sim = "my_package.sim:evaluate"   # (policy, cfg, device) -> dict[str, float]
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from loongforge.core.accelerators import get_accelerator
from loongforge.core.config import ConfigError
from loongforge.core.errors import DataError
from loongforge.embodied.config import EmbodiedConfig
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.data.synthetic import ensure_synthetic_dataset
from loongforge.embodied.restore import restore_policy

ENTRY_POINT_GROUP = "loongforge.embodied.eval_hooks"


class EvalHook(Protocol):
    def __call__(self, policy: nn.Module, cfg: EmbodiedConfig, device: torch.device) -> dict[str, float]: ...


@torch.no_grad()
def offline_action_mse(policy: nn.Module, cfg: EmbodiedConfig, device: torch.device) -> dict[str, float]:
    """MSE of sampled chunks vs. recorded actions on the held-out episodes (valid steps and real
    action dimensions only), in normalised units and in the dataset's own units."""
    root = cfg.data.path or str(ensure_synthetic_dataset())
    ds = EmbodiedDataset(cfg.data, cfg.model, root, "eval")
    loader = DataLoader(ds, batch_size=cfg.eval.batch_size, shuffle=False, num_workers=cfg.data.num_workers)
    g = torch.Generator().manual_seed(cfg.eval.seed)
    key, adim = ds.spec.action_key, ds.spec.action_dim
    sums = torch.zeros(2, dtype=torch.float64)
    count, samples = 0.0, 0
    policy.eval()
    for i, batch in enumerate(loader):
        if i >= cfg.eval.max_batches:
            break
        b = batch["actions"].shape[0]
        noise = torch.randn(b, cfg.model.chunk_size, cfg.model.max_action_dim, generator=g)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        pred = policy.sample_actions(batch, noise.to(device)).cpu()[..., :adim]
        target = batch["actions"].cpu()[..., :adim]
        valid = (~batch["action_is_pad"].cpu()).float()[..., None]
        sums[0] += (((pred - target) ** 2) * valid).sum().double()
        raw_pred, raw_target = ds.normalizer.unnormalize(key, pred), ds.normalizer.unnormalize(key, target)
        sums[1] += (((raw_pred - raw_target) ** 2) * valid).sum().double()
        count += float(valid.sum()) * adim
        samples += b
    if samples == 0:
        raise DataError(f"no held-out samples to evaluate (dataset {root}, episodes {ds.episodes})")
    return {"action_mse_normalized": float(sums[0] / count), "action_mse": float(sums[1] / count),
            "samples": samples, "episodes": len(ds.episodes)}


BUILTIN_HOOKS: dict[str, EvalHook] = {"offline_mse": offline_action_mse}


def get_eval_hook(name: str) -> EvalHook:
    if name in BUILTIN_HOOKS:
        return BUILTIN_HOOKS[name]
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        raise ConfigError(f"eval.hook={name!r}: not built in ({sorted(BUILTIN_HOOKS)}) nor registered under {ENTRY_POINT_GROUP} ({sorted(found)})")
    return found[name].load()


def evaluate_checkpoint(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, float]:
    """Run ``eval.hook`` on the policy saved at ``path`` (a run directory, checkpoint root or step directory)."""
    policy, cfg, ckpt = restore_policy(path, overrides)
    device = get_accelerator().device()
    policy.to(device)
    metrics = get_eval_hook(cfg.eval.hook)(policy, cfg, device)
    return {"step": ckpt.step, **metrics}
