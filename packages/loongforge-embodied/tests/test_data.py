"""Data pipeline vs. values computed directly from the parquet/JSON files LeRobot wrote."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from embodied_helpers import CAMERAS, EPISODE_LENGTHS, TASKS
from loongforge.core.errors import DataError
from loongforge.embodied.config import DatasetConfig, PolicyConfig
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.data.images import resize_with_pad
from loongforge.embodied.data.sampler import StepBatchSampler
from loongforge.embodied.data.tokenizer import BYTE_OFFSET, BOS, SEP, STATE_OFFSET, ByteTokenizer

CHUNK = 4


def read_frames(root: Path):
    files = sorted((root / "data").rglob("*.parquet"))
    tables = [pq.read_table(f).to_pydict() for f in files]
    rows = {k: sum((t[k] for t in tables), []) for k in tables[0]}
    order = np.argsort(rows["index"])
    return {k: [v[i] for i in order] for k, v in rows.items()}


def make(root, split="train", **data_kw):
    data = DatasetConfig(path=str(root), repo_id="local/tiny", **data_kw)
    policy = PolicyConfig(chunk_size=CHUNK, max_state_dim=4, max_action_dim=4, num_cameras=3, image_size=16)
    return EmbodiedDataset(data, policy, str(root), split)


def expected_chunk(frames, idx):
    """Actions idx..idx+CHUNK-1 of idx's episode, the episode's last action repeated past its end."""
    ep = frames["episode_index"][idx]
    last = max(i for i, e in enumerate(frames["episode_index"]) if e == ep)
    rows = [min(idx + k, last) for k in range(CHUNK)]
    pad = [idx + k > last for k in range(CHUNK)]
    return np.array([frames["action"][r] for r in rows], dtype=np.float32), np.array(pad)


def test_chunks_and_mean_std_normalisation_match_parquet(tiny_dataset):
    frames = read_frames(tiny_dataset)
    ds = make(tiny_dataset, state_norm="mean_std", action_norm="mean_std")
    assert ds.episodes == [0, 1] and len(ds) == EPISODE_LENGTHS[0] + EPISODE_LENGTHS[1]
    states = np.array(frames["observation.state"], dtype=np.float64)
    actions = np.array(frames["action"], dtype=np.float64)
    # stats over every frame of the dataset, computed here from the parquet rows
    s_mean, s_std = states.mean(0), states.std(0)
    a_mean, a_std = actions.mean(0), actions.std(0)
    for idx in (0, 3, 5, 6, 7, 15):  # 5, 6 and 15 run past their episode's end
        item = ds[idx]
        chunk, pad = expected_chunk(frames, idx)
        want = (chunk - a_mean) / (a_std + 1e-8)
        np.testing.assert_allclose(item["actions"][:, :2].numpy(), want, rtol=1e-4, atol=1e-5)
        assert torch.all(item["actions"][:, 2:] == 0)
        np.testing.assert_array_equal(item["action_is_pad"].numpy(), pad)
        want_state = (states[idx] - s_mean) / (s_std + 1e-8)
        np.testing.assert_allclose(item["state"][:3].numpy(), want_state, rtol=1e-4, atol=1e-5)
        assert item["state"][3] == 0
        assert item["action_dim_mask"].tolist() == [True, True, False, False]
    assert ds[5]["action_is_pad"].tolist() == [False, False, True, True]


def test_quantile_normalisation_uses_stats_json(tiny_dataset):
    frames = read_frames(tiny_dataset)
    stats = json.loads((tiny_dataset / "meta/stats.json").read_text())
    ds = make(tiny_dataset)  # quantiles (the default, as Pi0.5)
    q01, q99 = np.array(stats["action"]["q01"]), np.array(stats["action"]["q99"])
    chunk, _ = expected_chunk(frames, 2)
    want = 2 * (chunk - q01) / (q99 - q01) - 1
    np.testing.assert_allclose(ds[2]["actions"][:, :2].numpy(), want, rtol=1e-4, atol=1e-5)


def test_cameras_tokens_and_eval_split(tiny_dataset):
    frames = read_frames(tiny_dataset)
    ds = make(tiny_dataset, state_norm="mean_std")
    idx = 8  # episode 1, task 1
    item = ds[idx]
    assert item["image_mask"].tolist() == [True, True, False]  # the third slot has no camera
    assert torch.all(item["images"][2] == -1)
    for slot, cam in enumerate(CAMERAS):
        png = frames[cam][idx]["bytes"]
        pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(png)))).permute(2, 0, 1).float() / 255
        want = resize_with_pad(pixels, 16) * 2 - 1
        torch.testing.assert_close(item["images"][slot], want, atol=1e-5, rtol=0)
    # the wrist camera (12x20) is letterboxed: top/bottom rows are padding (-1)
    assert torch.all(item["images"][1][:, 0] == -1) and item["images"][1][:, 8].max() > -1
    # prompt: BOS, instruction bytes (cleaned), SEP, 256-bin state tokens (Pi0.5 digitisation), SEP
    text = TASKS[1].strip().replace("_", " ").replace("\n", " ").encode()
    bins = np.digitize(item["state"][:3].numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    want = [BOS] + [BYTE_OFFSET + b for b in text] + [SEP] + [STATE_OFFSET + int(b) for b in bins] + [SEP]
    n = int(item["token_mask"].sum())
    assert item["tokens"][:n].tolist() == want and torch.all(item["tokens"][n:] == 0)
    held_out = make(tiny_dataset, split="eval")
    assert held_out.episodes == [2] and len(held_out) == EPISODE_LENGTHS[2]
    assert int(held_out[0]["episode_index"]) == 2


def test_tokenizer_rejects_too_short_prompt():
    with pytest.raises(ValueError, match="max_token_len=4"):
        ByteTokenizer(4, discrete_state=True).encode("x", torch.zeros(3))


def test_sampler_splits_and_resumes_exactly():
    one = StepBatchSampler(10, 4, rank=0, world=1, seed=3)
    halves = [StepBatchSampler(10, 4, rank=r, world=2, seed=3) for r in range(2)]
    for step in range(7):  # crosses epoch boundaries (10 samples, 4 per step)
        assert halves[0].local_batch(step) + halves[1].local_batch(step) == one.local_batch(step)
    stream = iter(one)
    seen = [next(stream) for _ in range(5)]
    resumed = iter(StepBatchSampler(10, 4, rank=0, world=1, seed=3, start_step=3))
    assert [next(resumed), next(resumed)] == seen[3:5]
    epoch0 = sorted(one.global_batch(0) + one.global_batch(1) + one.global_batch(2)[:2])
    assert epoch0 == list(range(10))  # an epoch is a permutation


def test_missing_dataset_files_are_named(tmp_path):
    (tmp_path / "meta").mkdir()
    with pytest.raises(DataError, match="meta/info.json"):
        make(tmp_path)


def test_a_video_that_does_not_decode_names_the_episode_and_frame(tmp_path):
    from loongforge.embodied.data.synthetic import write_synthetic_dataset

    root = tmp_path / "video"
    write_synthetic_dataset(root, episodes=3, frames=8, image_size=64, use_videos=True)
    for video in (root / "videos").rglob("*.mp4"):
        video.write_bytes(video.read_bytes()[:200])  # truncated: the frames are gone
    ds = EmbodiedDataset(DatasetConfig(path=str(root)), PolicyConfig(image_size=64), str(root), "train")
    with pytest.raises(DataError, match=rf"dataset {root}: episode 1 frame 2: cannot be read"):
        ds[10]


def test_video_cameras_decode_to_the_recorded_frames(tmp_path):
    """Video-backed cameras (AV1 mp4 written by LeRobot, decoded with pyav) come out aligned with
    their frame: close to the rendered source image, and far from the same step of the next episode."""
    from loongforge.embodied.data.synthetic import TASKS as SYN_TASKS, render_frame, write_synthetic_dataset

    root = tmp_path / "video"
    write_synthetic_dataset(root, episodes=3, frames=8, image_size=64, use_videos=True)
    assert len(list((root / "videos").rglob("*.mp4"))) == 2
    ds = EmbodiedDataset(DatasetConfig(path=str(root)), PolicyConfig(image_size=64), str(root), "train")
    frames = read_frames(root)

    def rendered(idx, slot):
        x, y = frames["observation.state"][idx][:2]
        img = render_frame(x, y, frames["task_index"][idx] % len(SYN_TASKS), 64, slot)
        return torch.from_numpy(img).permute(2, 0, 1).float() / 255 * 2 - 1

    for idx in (1, 6, 9):
        item = ds[idx]
        for slot in range(2):
            err = (item["images"][slot] - rendered(idx, slot)).abs().mean()
            other = (item["images"][slot] - rendered(idx + 8, slot)).abs().mean()
            assert err < 0.02 and other > 3 * err
