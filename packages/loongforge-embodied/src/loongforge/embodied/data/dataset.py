"""A LeRobot dataset as policy samples.

Each item is one frame with its action chunk: the next ``chunk_size`` actions of the same
episode (LeRobot ``delta_timestamps`` windows; steps past the episode end are repeated and
flagged in ``action_is_pad``), the normalised and zero-padded state, every camera slot resized
to the policy's image size in [-1, 1] with a presence mask, and the language instruction as
tokens (with the discretised state for Pi0.5-style prompts; ``data.tokenizer.make_tokenizer`` picks
the tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from loongforge.core.config import ConfigError
from loongforge.core.errors import DataError
from loongforge.embodied.config import DatasetConfig, PolicyConfig
from loongforge.embodied.data.images import resize_with_pad, to_model_range
from loongforge.embodied.data.lerobot_source import (
    open_lerobot_dataset,
    open_metadata,
    split_episodes,
)
from loongforge.embodied.data.normalize import Normalizer
from loongforge.embodied.data.tokenizer import make_tokenizer


@dataclass(frozen=True)
class DatasetSpec:
    """What a policy needs to know about its dataset (recorded in checkpoints)."""

    fps: int
    state_dim: int
    action_dim: int
    camera_keys: tuple[str, ...]
    state_key: str
    action_key: str


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] > size:
        raise DataError(f"a feature of size {x.shape[-1]} does not fit the policy's padded size {size}")
    return torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def chunk_timestamps(fps: int, chunk_size: int) -> list[float]:
    return [i / fps for i in range(chunk_size)]


class EmbodiedDataset(Dataset):
    def __init__(self, data_cfg: DatasetConfig, policy_cfg: PolicyConfig, root: str, split: str = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: one of train, eval")
        self.meta = open_metadata(root, data_cfg.repo_id)
        features = self.meta.features
        for key in (data_cfg.state_key, data_cfg.action_key):
            if key not in features:
                raise DataError(f"dataset {root}: no feature {key!r} in meta/info.json (have: {sorted(features)})")
        cameras = list(self.meta.camera_keys) if data_cfg.image_keys is None else list(data_cfg.image_keys)
        for key in cameras:
            if key not in self.meta.camera_keys:
                raise ConfigError(f"data.image_keys: {key!r} is not a camera of {root} (cameras: {self.meta.camera_keys})")
        if len(cameras) > policy_cfg.num_cameras:
            raise DataError(f"dataset {root} has {len(cameras)} cameras but model.num_cameras={policy_cfg.num_cameras}")
        self.spec = DatasetSpec(
            fps=int(self.meta.fps),
            state_dim=int(features[data_cfg.state_key]["shape"][0]),
            action_dim=int(features[data_cfg.action_key]["shape"][0]),
            camera_keys=tuple(cameras),
            state_key=data_cfg.state_key,
            action_key=data_cfg.action_key,
        )
        if self.spec.state_dim > policy_cfg.max_state_dim or self.spec.action_dim > policy_cfg.max_action_dim:
            raise DataError(
                f"dataset {root}: state/action dims {self.spec.state_dim}/{self.spec.action_dim} exceed "
                f"model.max_state_dim/max_action_dim {policy_cfg.max_state_dim}/{policy_cfg.max_action_dim}"
            )
        train_eps, eval_eps = split_episodes(self.meta.total_episodes, data_cfg.eval_episodes)
        self.episodes = train_eps if split == "train" else eval_eps
        if not self.episodes:
            raise DataError(f"dataset {root}: the {split} split is empty (data.eval_episodes={data_cfg.eval_episodes})")
        self.source = open_lerobot_dataset(
            self.meta,
            self.episodes,
            {data_cfg.action_key: chunk_timestamps(self.spec.fps, policy_cfg.chunk_size)},
            data_cfg.video_backend,
        )
        try:
            self.normalizer = Normalizer(
                self.meta.stats, {data_cfg.state_key: data_cfg.state_norm, data_cfg.action_key: data_cfg.action_norm}
            )
        except KeyError as exc:  # statistics the normalisation needs are not in the dataset's
            raise DataError(f"dataset {root}: meta/stats.json: {exc.args[0]}") from exc
        self.tokenizer = make_tokenizer(policy_cfg, data_cfg.tokenizer)
        if self.tokenizer.vocab_size > policy_cfg.vocab_size:
            raise ConfigError(f"policy.vocab_size={policy_cfg.vocab_size} < tokenizer vocabulary {self.tokenizer.vocab_size}")
        self.data_cfg = data_cfg
        self.policy_cfg = policy_cfg

    def __len__(self) -> int:
        return len(self.source)

    def _where(self, idx: int) -> str:
        """``episode E frame F`` of sample ``idx`` (its parquet row), else ``sample idx``."""
        try:
            row = self.source.hf_dataset[idx]
            return f"episode {int(row['episode_index'])} frame {int(row['frame_index'])}"
        except Exception:  # the row itself cannot be read
            return f"sample {idx}"

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        try:
            raw = self.source[idx]
        except Exception as exc:  # a frame that does not decode, a row that cannot be read
            raise DataError(f"dataset {self.meta.root}: {self._where(idx)}: cannot be read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
        spec, pcfg = self.spec, self.policy_cfg
        state = self.normalizer.normalize(spec.state_key, raw[spec.state_key])
        actions = self.normalizer.normalize(spec.action_key, raw[spec.action_key])
        size = pcfg.image_size
        images = torch.full((pcfg.num_cameras, 3, size, size), -1.0)
        image_mask = torch.zeros(pcfg.num_cameras, dtype=torch.bool)
        for slot, key in enumerate(spec.camera_keys):
            images[slot] = to_model_range(resize_with_pad(raw[key], size))
            image_mask[slot] = True
        tokens, token_mask = self.tokenizer.encode(raw["task"], state)
        return {
            "images": images,
            "image_mask": image_mask,
            "tokens": tokens,
            "token_mask": token_mask,
            "state": pad_last(state, pcfg.max_state_dim),
            "actions": pad_last(actions, pcfg.max_action_dim),
            "action_is_pad": raw[f"{spec.action_key}_is_pad"],
            "action_dim_mask": torch.arange(pcfg.max_action_dim) < spec.action_dim,
            "episode_index": raw["episode_index"],
            "frame_index": raw["frame_index"],
        }
