"""The data pipeline: image patches and grids as transformers' Qwen2-VL processor makes them,
window layouts as transformers' Qwen2.5-VL ViT orders them, records, video sampling, packing."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from loongforge.llm.api import DataError
from loongforge.vlm.data import media as M
from loongforge.vlm.data.packing import document_causal_mask, pack, pack_thd
from loongforge.vlm.data.records import read_records
from loongforge.vlm.encoders import geometry

GEO = M.PatchGeometry(patch_size=8, temporal_patch_size=2, merge=2)


@pytest.mark.parametrize("size", [(37, 101), (64, 64), (300, 41), (500, 700), (5, 40)])
def test_pixel_budget_matches_transformers_smart_resize(size):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    assert M.fit_size(*size, 16, 32 * 32, 96 * 96) == smart_resize(*size, factor=16, min_pixels=32 * 32, max_pixels=96 * 96)


def test_image_patches_match_transformers_processor(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    path = tmp_path / "x.png"
    Image.fromarray(rng.integers(0, 255, (53, 90, 3), dtype=np.uint8)).save(path)
    cfg = M.MediaConfig(min_pixels=32 * 32, max_pixels=80 * 80)
    ours, grid = M.load_image(path, cfg, GEO)
    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=8, merge_size=2,
                                  temporal_patch_size=2)(Image.open(path), return_tensors="np")
    assert [list(grid)] == hf["image_grid_thw"].tolist()
    np.testing.assert_allclose(ours, hf["pixel_values"], atol=1e-5)


@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 6, 10), (2, 4, 12)], [(3, 10, 6), (1, 2, 2)]])
def test_window_order_matches_transformers(grids):
    from transformers.vision_utils import get_vision_window_index

    grid_thw = torch.tensor(grids)
    order, lengths = geometry.window_order(grid_thw, merge=2, window_units=2)
    hf_order, hf_cu = get_vision_window_index(grid_thw, spatial_merge_size=2, window_size=32, patch_size=8)
    assert order.tolist() == hf_order.tolist()
    assert torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).tolist() == hf_cu.tolist()


def test_video_sampling_reads_frames_at_the_target_rate(vlm_cache):
    from loongforge.vlm.data.shipped import VIDEO_FPS, VIDEO_FRAMES

    video = next((vlm_cache / "shapes-v1" / "videos").glob("*.mp4"))
    info = M.probe_video(video)
    assert (info.frames, info.fps) == (VIDEO_FRAMES, VIDEO_FPS)
    cfg = M.MediaConfig(video_fps=2.0, video_max_frames=8, video_min_pixels=32 * 32, video_max_pixels=48 * 48)
    sampling = M.video_sampling(info, cfg, GEO, "test")
    assert sampling.indices == (0, 2, 5, 7)  # 2 s at 2 fps: 4 frames, evenly spread
    assert sampling.grid == (2, 6, 6) and sampling.seconds_per_grid_t == pytest.approx(1.0)
    patches, grid = M.load_video(video, sampling, cfg, GEO)
    assert grid == sampling.grid and patches.shape == (2 * 6 * 6, 3 * 2 * 8 * 8)
    assert patches.std() > 0.1  # real pixels, not a blank decode


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_place_untagged_media_first_and_name_bad_lines(tmp_path):
    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    good = {"image": "a.png", "conversations": [{"from": "human", "value": "What?"}, {"from": "gpt", "value": "Black."}]}
    (record,) = read_records(write_jsonl(tmp_path / "ok.jsonl", [good]))
    assert record.messages[0]["content"] == "<image>\nWhat?" and record.media == [("image", tmp_path / "a.png")]
    two_tags = {**good, "conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]}
    with pytest.raises(DataError, match=r"bad.jsonl:2: 2 <image> and 0 <video> tags for 1 image"):
        list(read_records(write_jsonl(tmp_path / "bad.jsonl", [good, two_tags])))
    missing = {**good, "image": "nope.png"}
    with pytest.raises(DataError, match=r"missing.jsonl:1: image file not found: .*nope.png"):
        list(read_records(write_jsonl(tmp_path / "missing.jsonl", [missing])))


def test_packing_keeps_samples_apart():
    mask = document_causal_mask([2, 3])[0, 0]
    allowed = ~mask
    assert allowed[1, 0] and not allowed[0, 1]  # causal within the first sample
    assert not allowed[2, 1] and allowed[4, 2]  # nothing across samples, causal within the second
    sample = lambda n, p: {"tokens": np.arange(n), "labels": np.arange(n), "loss_mask": np.ones(n, dtype=np.int64),
                           "position_ids": np.tile(np.arange(n), (3, 1)), "pixel_values": np.ones((p, 4), np.float32),
                           "grid_thw": np.asarray([[1, 1, p]])}
    row = pack([sample(2, 4), sample(3, 8)])
    assert row["tokens"].shape == (1, 5) and row["position_ids"].shape == (3, 1, 5)
    assert row["position_ids"][0, 0].tolist() == [0, 1, 0, 1, 2]
    assert row["pixel_values"].shape == (12, 4) and row["grid_thw"].tolist() == [[1, 1, 4], [1, 1, 8]]
    assert pack([sample(2, 4)])["attention_mask"] is None  # one sample: plain causal attention


def packing_sample(n, p):
    return {"tokens": np.arange(1, n + 1), "labels": np.arange(n) + 10, "loss_mask": np.ones(n, dtype=np.int64),
            "position_ids": np.stack([np.arange(n), np.arange(n) + 100, np.arange(n) + 200]),
            "pixel_values": np.ones((p, 4), np.float32), "grid_thw": np.asarray([[1, 1, p]])}


def test_thd_packing_pads_samples_for_context_parallelism():
    """THD rows: cu_seqlens instead of the T x T mask; with pad_multiple=2*cp each sample padded
    (pad tokens without loss, position 0), and the 3-D positions laid out like the tokens."""
    row = pack_thd([packing_sample(2, 4), packing_sample(3, 8)])
    assert row["attention_mask"] is None and row["cu_seqlens"].tolist() == [0, 2, 5]
    assert row["position_ids"].shape == (3, 1, 5) and row["position_ids"][1, 0].tolist() == [100, 101, 100, 101, 102]
    row = pack_thd([packing_sample(2, 4), packing_sample(3, 8)], pad_multiple=4)
    assert row["cu_seqlens"].tolist() == [0, 2, 5] and row["cu_seqlens_padded"].tolist() == [0, 4, 8]
    assert row["tokens"][0].tolist() == [1, 2, 0, 0, 1, 2, 3, 0]
    assert row["loss_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 1, 0]
    assert row["position_ids"][2, 0].tolist() == [200, 201, 0, 0, 200, 201, 202, 0]
    assert row["pixel_values"].shape == (12, 4) and row["grid_thw"].tolist() == [[1, 1, 4], [1, 1, 8]]


def test_cp_share_splits_labels_and_positions_and_keeps_the_whole_row():
    """Each CP rank keeps chunks r and 2*cp-1-r of every padded sample of the labels, loss mask and
    3-D positions; the tokens and media stay whole (the model embeds the whole row first)."""
    from loongforge.vlm.context_parallel import collate_cp_share, local_rows

    samples = [packing_sample(2, 4), packing_sample(3, 8)]
    whole = pack_thd(samples, pad_multiple=4)
    shares = [collate_cp_share(2, r, samples) for r in range(2)]
    assert [s["cp_index"].tolist() for s in shares] == [[0, 3, 4, 7], [1, 2, 5, 6]]
    for share in shares:
        index = share["cp_index"]
        assert torch.equal(share["tokens"], whole["tokens"]) and torch.equal(share["grid_thw"], whole["grid_thw"])
        assert torch.equal(share["labels"], whole["labels"][:, index])
        assert torch.equal(share["loss_mask"], whole["loss_mask"][:, index])
        assert torch.equal(share["position_ids"], whole["position_ids"][..., index])
        hidden = torch.arange(8.0)[:, None, None].expand(8, 1, 3)
        assert local_rows(hidden, index)[:, 0, 0].tolist() == index.float().tolist()


def test_qwen3_vl_video_layout_stamps_each_frame_group(vlm_cache):
    """With ``vision.rope: mrope_interleaved`` (Qwen3-VL) a video is one run of tokens per temporal
    patch group after its ``<t seconds>`` text, stamped as transformers' Qwen3-VL processor stamps
    it; the sample's positions place each group as an image of its own."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.data.dataset import frame_seconds
    from loongforge.vlm.positions import VisionItem, mrope_positions
    from loongforge.vlm.recipe import VLMTask

    task = VLMTask(load_vlm_config("qwen3_vl_debug", [f"data.cache_dir={vlm_cache}"]))
    data = task.dataset()
    j = next(i for i in range(len(data)) if [p.kind for p in data.index.media[int(data.keep[i])]] == ["video"])
    (plan,) = data.index.media[int(data.keep[j])]
    seconds = frame_seconds(plan)
    assert seconds == pytest.approx(Qwen3VLProcessor._calculate_timestamps(None, list(plan.frames), plan.fps, 2))
    sample = data[j]
    text = task.tokenizer.decode(sample["tokens"])
    stamps = [f"<{t:.1f} seconds><|vision_start|>" for t in seconds]
    assert all(s in text for s in stamps) and text.count("<|vision_start|>") == plan.grid[0]
    t, h, w = plan.grid
    is_video = sample["tokens"] == data.ids.video
    runs = np.flatnonzero(np.diff(np.concatenate([[0], is_video.astype(int), [0]])) == 1)
    assert len(runs) == t and is_video.sum() == t * h * w // 4
    frames = mrope_positions(sample["tokens"], [VisionItem((1, h, w), True)] * t, (data.ids.image, data.ids.video), 2, 2.0)
    np.testing.assert_array_equal(sample["position_ids"], frames)
