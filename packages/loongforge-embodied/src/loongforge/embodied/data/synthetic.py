"""A small synthetic LeRobot dataset, written with LeRobot's own API, for the zero-argument demo.

A 2-D point moves on a circle; the state is ``[x, y, vx, vy]``; two cameras see a coloured
square at the point (the colour names the task); the action is the displacement towards a
task-dependent goal plus a rotation, so it is a learnable function of state, image and
instruction. ``ensure_synthetic_dataset()`` writes it once into the cache directory
(``$LOONGFORGE_CACHE`` or ``$XDG_CACHE_HOME/loongforge`` or ``~/.cache/loongforge``), atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SYNTHETIC_NAME = "embodied-synthetic-v1"
TASKS = ("move the red square to the left", "move the blue square to the right")


def cache_dir() -> Path:
    """The LoongForge cache (``loongforge.core.cache``)."""
    from loongforge.core.cache import cache_root

    return cache_root()


def synthetic_features(image_size: int, cameras: tuple[str, ...], use_videos: bool = False) -> dict:
    features = {
        "observation.state": {"dtype": "float32", "shape": (4,), "names": ["x", "y", "vx", "vy"]},
        "action": {"dtype": "float32", "shape": (3,), "names": ["dx", "dy", "grip"]},
    }
    for cam in cameras:
        features[cam] = {"dtype": "video" if use_videos else "image", "shape": (image_size, image_size, 3), "names": ["height", "width", "channels"]}
    return features


COLOURS = (np.array([220, 40, 40], np.uint8), np.array([40, 60, 220], np.uint8))


def render_frame(x: float, y: float, task: int, size: int, camera: int) -> np.ndarray:
    """Camera ``camera``'s ``[size, size, 3]`` uint8 view of the point (x, y) for task ``task``."""
    colour, zoom = COLOURS[task], 1.0 + 0.5 * camera
    img = np.full((size, size, 3), 30, dtype=np.uint8)
    cx = int(round((x * zoom * 0.4 + 0.5) * (size - 1)))
    cy = int(round((y * zoom * 0.4 + 0.5) * (size - 1)))
    r = max(1, size // 10)
    img[max(0, cy - r) : cy + r + 1, max(0, cx - r) : cx + r + 1] = colour
    return img


def write_synthetic_dataset(
    root: str | Path,
    *,
    episodes: int = 8,
    frames: int = 30,
    image_size: int = 24,
    cameras: tuple[str, ...] = ("observation.images.top", "observation.images.wrist"),
    fps: int = 10,
    seed: int = 0,
    repo_id: str = "local/" + SYNTHETIC_NAME,
    use_videos: bool = False,
):
    """Write the dataset to ``root`` (which must not exist) and return the finalised dataset."""
    from lerobot.datasets import LeRobotDataset

    rng = np.random.default_rng(seed)
    ds = LeRobotDataset.create(
        repo_id, fps=fps, features=synthetic_features(image_size, cameras, use_videos), root=root, use_videos=use_videos
    )
    for ep in range(episodes):
        task = ep % len(TASKS)
        goal = np.array([-0.8, 0.0]) if task == 0 else np.array([0.8, 0.0])
        pos = rng.uniform(-0.6, 0.6, size=2)
        vel: np.ndarray = np.zeros(2)
        for t in range(frames):
            rot = np.array([-pos[1], pos[0]]) * 0.3
            move = 0.25 * (goal - pos) + rot
            grip = np.tanh(2.0 * (np.linalg.norm(goal - pos) - 0.5))
            action = np.array([move[0], move[1], grip], dtype=np.float32)
            frame = {
                "observation.state": np.concatenate([pos, vel]).astype(np.float32),
                "action": action,
                "task": TASKS[task],
            }
            for i, cam in enumerate(cameras):
                frame[cam] = render_frame(pos[0], pos[1], task, image_size, i)
            ds.add_frame(frame)
            vel = move + rng.normal(scale=0.01, size=2)
            pos = np.clip(pos + 0.3 * vel, -1.2, 1.2)
        ds.save_episode(parallel_encoding=False)  # no process pool: safe in multi-threaded callers
    ds.finalize()
    return ds


def ensure_synthetic_dataset(directory: Path | None = None) -> Path:
    """The synthetic dataset's root, written on first use (``loongforge.core.cache.write_atomically``)."""
    from loongforge.core.cache import write_atomically

    def write(tmp: Path) -> None:
        tmp.rmdir()  # LeRobotDataset.create makes the directory itself
        write_synthetic_dataset(tmp)

    root = (directory or cache_dir()) / SYNTHETIC_NAME
    if not (root / "meta" / "info.json").is_file():
        write_atomically(root, write)
    return root
