"""Open a LeRobot dataset from a local directory, never from the Hub.

``LeRobotDataset`` downloads whatever it cannot find locally; here every file it would need
(``meta/info.json``, stats, tasks, episodes, each episode's parquet and video files) is checked
first, so a missing file is an error naming it instead of a network request.
"""

from __future__ import annotations

import json
from pathlib import Path

from loongforge.core.errors import DataError

META_FILES = ("meta/info.json", "meta/stats.json", "meta/tasks.parquet")


def check_local_dataset(root: Path) -> None:
    """Raise ``DataError`` naming the first metadata file under ``root`` that is missing or does
    not read (a JSON file that does not parse, a parquet file without its footer: truncated copies)."""
    if not root.is_dir():
        raise DataError(f"data.path={str(root)!r}: not a directory")
    for rel in META_FILES:
        if not (root / rel).is_file():
            raise DataError(f"data.path={str(root)!r}: missing {rel} (not a LeRobot v3 dataset?)")
    if not (root / "meta/episodes").is_dir():
        raise DataError(f"data.path={str(root)!r}: missing meta/episodes/")
    for rel in META_FILES:
        check_readable(root / rel)
    for path in sorted((root / "meta/episodes").rglob("*.parquet")):
        check_readable(path)


def check_readable(path: Path) -> None:
    """``path`` (a ``.json`` or ``.parquet`` metadata file) parses; else a ``DataError`` naming it."""
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{path}: not valid JSON ({exc}); the file may be truncated") from None
    elif path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path).close()
        except pyarrow.ArrowException as exc:
            raise DataError(f"{path}: not a readable parquet file ({exc}); the file may be truncated") from None


def open_metadata(root: str | Path, repo_id: str):
    """The dataset's ``LeRobotDatasetMetadata`` (local files only)."""
    from lerobot.datasets import LeRobotDatasetMetadata

    root = Path(root)
    check_local_dataset(root)
    return LeRobotDatasetMetadata(repo_id, root=root)


def check_episode_files(meta, episodes: list[int]) -> None:
    for ep in episodes:
        paths = [meta.get_data_file_path(ep)] + [meta.get_video_file_path(ep, key) for key in meta.video_keys]
        for rel in paths:
            if not (meta.root / rel).is_file():
                raise DataError(f"dataset {meta.root}: episode {ep} needs {rel}, which is missing")


def open_lerobot_dataset(meta, episodes: list[int], delta_timestamps: dict[str, list[float]], video_backend: str):
    """A read-only ``LeRobotDataset`` over ``episodes`` of an already-opened local dataset."""
    from lerobot.datasets import LeRobotDataset

    check_episode_files(meta, episodes)
    return LeRobotDataset(
        meta.repo_id,
        root=meta.root,
        episodes=episodes,
        delta_timestamps=delta_timestamps,
        video_backend=video_backend,
    )


def split_episodes(total: int, eval_episodes: int) -> tuple[list[int], list[int]]:
    """(train, held-out) episode indices: the last ``eval_episodes`` are held out."""
    if total < 1:
        raise DataError("the dataset has no episodes")
    if eval_episodes >= total:
        raise DataError(f"data.eval_episodes={eval_episodes} leaves no training episode (the dataset has {total})")
    cut = total - eval_episodes
    return list(range(cut)), list(range(cut, total))
