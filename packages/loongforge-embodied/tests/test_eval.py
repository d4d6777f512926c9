"""Offline action MSE on the held-out episode vs. a direct computation from the parquet rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from embodied_helpers import tiny_overrides, train
from loongforge.core.config import ConfigError
from loongforge.embodied.config import load_train_config
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.evaluation import evaluate_checkpoint, get_eval_hook
from loongforge.embodied.restore import restore_policy
from test_data import expected_chunk, read_frames


def test_offline_mse_matches_direct_computation(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    train(load_train_config("train", tiny_overrides(tiny_dataset, run_dir, "train.steps=2", "log.tensorboard=false")))
    overrides = ["eval.batch_size=4", "eval.max_batches=5", "eval.seed=7"]
    metrics = evaluate_checkpoint(run_dir, overrides)
    assert metrics["step"] == 2 and metrics["samples"] == 6 and metrics["episodes"] == 1

    policy, cfg, _ = restore_policy(run_dir / "checkpoints", overrides)
    policy.eval()
    ds = EmbodiedDataset(cfg.data, cfg.model, str(tiny_dataset), "eval")
    frames = read_frames(tiny_dataset)
    stats = json.loads((tiny_dataset / "meta/stats.json").read_text())["action"]
    q01, q99 = np.array(stats["q01"]), np.array(stats["q99"])
    g = torch.Generator().manual_seed(7)
    first = frames["episode_index"].index(2)
    sq_err, count = 0.0, 0
    for start in (0, 4):
        idx = list(range(start, min(start + 4, len(ds))))
        batch = default_collate([ds[i] for i in idx])
        noise = torch.randn(len(idx), cfg.model.chunk_size, cfg.model.max_action_dim, generator=g)
        pred = policy.sample_actions(batch, noise)[..., :2].double().numpy()
        pred = (pred + 1) / 2 * (q99 - q01) + q01  # undo the quantile normalisation by hand
        for row, i in enumerate(idx):
            chunk, pad = expected_chunk(frames, first + i)
            err = ((pred[row] - chunk) ** 2)[~pad]
            sq_err += err.sum()
            count += err.size
    assert metrics["action_mse"] == pytest.approx(sq_err / count, rel=1e-4)


def test_unknown_eval_hook_is_named():
    with pytest.raises(ConfigError, match="loongforge.embodied.eval_hooks"):
        get_eval_hook("mujoco_pick")


def test_the_eval_hook_runs_during_training(tiny_dataset, tmp_path):
    """``eval.interval``: the loop runs the policy's evaluation hook every N steps and logs it."""
    run_dir = tmp_path / "run"
    train(load_train_config("train", tiny_overrides(tiny_dataset, run_dir, "train.steps=4", "log.interval=1",
                                                    "eval.interval=2", "eval.max_batches=1", "log.tensorboard=false")))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if "eval/action_mse" in r]
    assert evaluated == [2, 4] and all(r["eval/action_mse"] > 0 and r["eval/samples"] > 0 for r in records if r["step"] in (2, 4))
