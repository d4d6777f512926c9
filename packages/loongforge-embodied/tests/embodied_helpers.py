"""Test helpers: a tiny LeRobot dataset written with LeRobot's own API, tiny config overrides."""

from __future__ import annotations

import numpy as np

EPISODE_LENGTHS = (7, 9, 6)
TASKS = ("pick the cube", "place_the cube\non the plate")
CAMERAS = {"observation.images.front": (16, 16), "observation.images.wrist": (12, 20)}  # (h, w)


def write_tiny_dataset(root, seed: int = 0):
    from lerobot.datasets import LeRobotDataset

    features = {
        "observation.state": {"dtype": "float32", "shape": (3,), "names": ["a", "b", "c"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    for cam, (h, w) in CAMERAS.items():
        features[cam] = {"dtype": "image", "shape": (h, w, 3), "names": ["height", "width", "channels"]}
    rng = np.random.default_rng(seed)
    ds = LeRobotDataset.create("local/tiny", fps=10, features=features, root=root, use_videos=False)
    for ep, n in enumerate(EPISODE_LENGTHS):
        for _ in range(n):
            frame = {
                "observation.state": rng.normal(size=3).astype(np.float32),
                "action": (rng.normal(size=2) * np.array([1.0, 3.0]) + np.array([0.5, -1.0])).astype(np.float32),
                "task": TASKS[ep % 2],
            }
            for cam, (h, w) in CAMERAS.items():
                frame[cam] = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    return root


LORA_OVERRIDES = ("lora.rank=4", "lora.alpha=16", "train.lr=0.02")  # a LoRA run's steps move the weights visibly


def tiny_overrides(dataset_root, run_dir, *extra: str) -> list[str]:
    """Config overrides for a fast CPU run on the tiny dataset."""
    return [
        f"data.path={dataset_root}",
        "data.repo_id=local/tiny",
        f"log.run_dir={run_dir}",
        "model.image_size=16",
        "model.chunk_size=4",
        "model.max_state_dim=4",
        "model.max_action_dim=4",
        "train.global_batch_size=4",
        "log.progress=false",
        *extra,
    ]


def train(cfg):
    """``lf-embodied train`` of ``cfg`` in this process: the loop's ``RunSummary``."""
    from loongforge.core.models import get_model_spec
    from loongforge.core.training.run import run_training

    return run_training(cfg, get_model_spec(cfg.model.family).make_task(cfg), "lf-embodied")


def policy_batch(cfg, b: int = 3, seed: int = 1, length: int = 20):
    """A random policy batch of ``b`` <= 3 samples (two cameras, the second missing in sample 1;
    ``length`` prompt tokens of which ``length``, ``length // 2 + 1`` and 4 are valid), with its
    noise and times: ``(batch, noise, t)``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    size = cfg.image_size
    return {
        "images": torch.rand(b, 2, 3, size, size, generator=g) * 2 - 1,
        "image_mask": torch.tensor([[True, True], [True, False], [True, True]])[:b],
        "tokens": torch.randint(0, cfg.vocab_size, (b, length), generator=g),
        "token_mask": torch.arange(length)[None] < torch.tensor([[length], [length // 2 + 1], [4]])[:b],
        "state": torch.randn(b, cfg.max_state_dim, generator=g),
        "actions": torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g),
    }, torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g), torch.rand(b, generator=g)
