"""The throughput harness runs both training steps (tiny sizes on CPU; no timing assertions)."""

from __future__ import annotations

import math

import pytest
import torch

from lerobot_reference import build_lerobot_pi05
from loongforge.core.distributed import init_distributed
from loongforge.embodied.bench import (
    build_lerobot_pi05_released,
    lerobot_step,
    loongforge_step,
    samples_per_second,
    synthetic_batch,
)
from loongforge.core.training.schema import TrainConfig
from loongforge.embodied.policies import build_policy, policy_config


def test_both_training_steps_run_and_update_weights():
    cfg = policy_config("pi05", image_size=16, chunk_size=4, max_token_len=12)
    env = init_distributed(group_for_world_of_one=False)
    batch = synthetic_batch(cfg, 2, env.device)
    torch.manual_seed(0)
    ours, ref = build_policy(cfg), build_lerobot_pi05(cfg)
    before = (ours.action_out_proj.weight.detach().clone(), ref.action_out_proj.weight.detach().clone())
    rates = [
        samples_per_second(loongforge_step(ours, TrainConfig(), env.device, batch, lr=1e-3), 2, steps=2, warmup=1, synchronize=env.accelerator.synchronize),
        samples_per_second(lerobot_step(ref, batch, lr=1e-3), 2, steps=2, warmup=1, synchronize=env.accelerator.synchronize),
    ]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert not torch.equal(before[0], ours.action_out_proj.weight) and not torch.equal(before[1], ref.action_out_proj.weight)
    with pytest.raises(ValueError, match="pi05_base"):
        build_lerobot_pi05_released(cfg)
