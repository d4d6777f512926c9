"""`lf-diffusion preprocess`: shards that reload to what the encoders compute, and resume."""

import json
from pathlib import Path

import pytest
import torch

from loongforge.diffusion.data import shards
from loongforge.diffusion.data.encoders import encode_prompts, encode_video, load_text_encoder, load_vae
from loongforge.diffusion.data.shards import LatentShards
from loongforge.diffusion.data.synthetic import generate_clips
from loongforge.diffusion.data.video_io import read_frames, to_model_input
from loongforge.diffusion.preprocess import PreprocessConfig, preprocess


@pytest.fixture
def setup(tmp_path, builtin_latents):
    clips = generate_clips(tmp_path / "clips", num_clips=5, seed=7)
    encoders = builtin_latents.parent / "encoders"
    cfg = PreprocessConfig(input=str(clips), output=str(tmp_path / "out"), vae=str(encoders), text_encoder=str(encoders),
                           max_sequence_length=16, max_frames=9, max_area=48 * 48, shard_size=2, progress=False)
    return cfg, clips, encoders


def test_shards_reload_to_encoder_outputs(setup):
    cfg, clips, encoders = setup
    manifest = preprocess(cfg)
    assert manifest is not None and manifest.name == "manifest.json"
    data = LatentShards(cfg.output)
    assert len(data) == 5 and len(data.manifest["shards"]) == 3
    assert data.manifest["latent_channels"] == 4 and data.manifest["text_dim"] == 32
    rows = [json.loads(line) for line in (clips / "metadata.jsonl").read_text().splitlines()]
    vae = load_vae(encoders, "cpu")
    tokenizer, encoder = load_text_encoder(encoders, None, "cpu")
    for i, row in enumerate(rows):
        latents, text = data.load(i)
        video = to_model_input(read_frames(clips / row["file_name"], 9), 48 * 48, 16, 4)
        torch.testing.assert_close(latents, encode_video(vae, video))
        (expected_text,) = encode_prompts(tokenizer, encoder, [row["text"]], 16)
        torch.testing.assert_close(text, expected_text)
        assert data.records[i]["text"] == row["text"]
        # spatial latent sides are multiples of the 2x2 patch; frames follow the 4x causal grid
        _, f, h, w = latents.shape
        assert h % 2 == 0 and w % 2 == 0 and (video.shape[1] - 1) // 4 + 1 == f


def test_resume_skips_finished_shards(setup):
    cfg, _, _ = setup
    preprocess(cfg)
    out = Path(cfg.output)
    stamps = {i: (out / shards.shard_name(i)).stat().st_mtime_ns for i in range(3)}
    before = LatentShards(out).load(3)
    # an interrupted run: shard 1 was never finished (no record), the manifest not yet written
    (out / shards.record_name(1)).unlink()
    (out / shards.shard_name(1)).unlink()
    (out / shards.MANIFEST).unlink()
    assert preprocess(cfg) is not None
    assert (out / shards.shard_name(0)).stat().st_mtime_ns == stamps[0]
    assert (out / shards.shard_name(2)).stat().st_mtime_ns == stamps[2]
    after = LatentShards(out)
    assert len(after) == 5
    torch.testing.assert_close(after.load(3)[0], before[0])


def test_ranks_split_shards_and_settings_are_checked(setup):
    cfg, _, _ = setup
    assert preprocess(cfg, rank=1, world=2) is None  # rank 1: shard 1 only; no manifest yet
    out = Path(cfg.output)
    assert [shards.finished_record(out, i) is not None for i in range(3)] == [False, True, False]
    assert preprocess(cfg, rank=0, world=2) is not None  # rank 0: shards 0, 2 and the manifest
    cfg.max_frames = 5
    with pytest.raises(ValueError, match=r"preprocess.json: this directory was preprocessed with max_frames=9"):
        preprocess(cfg)


def test_cli_preprocess_with_shipped_defaults(setup, capsys):
    from loongforge.diffusion.cli import main

    cfg, clips, encoders = setup
    args = [f"input={clips}", f"output={cfg.output}", f"vae={encoders}", f"text_encoder={encoders}",
            "max_sequence_length=16", "max_area=2304", "progress=false"]
    assert main(["preprocess", *args]) == 0
    assert "manifest.json" in capsys.readouterr().out
    data = LatentShards(cfg.output)
    assert len(data) == 5 and data.load(0)[0].dtype == torch.float32  # stored bf16 (shipped default), read as fp32
    assert json.loads((Path(cfg.output) / "preprocess.json").read_text())["storage_dtype"] == "bf16"
    assert main(["preprocess", *args[:-2]]) == 2  # other settings into the same directory: refused
    assert "preprocess.json: this directory was preprocessed with max_area=2304" in capsys.readouterr().err


@pytest.mark.long  # (the default tier's budget: the one-process CLI preprocessing is tested above)
def test_cli_preprocess_under_torchrun_equals_one_process(setup, tmp_path):
    """Two ranks (gloo) split the shards, the manifest waits for both, and the result equals one
    process's."""
    import os
    import subprocess
    import sys

    from loongforge.diffusion.cli import main

    _, clips, encoders = setup
    args = [f"input={clips}", f"vae={encoders}", f"text_encoder={encoders}", "max_sequence_length=16", "max_frames=9",
            "max_area=2304", "shard_size=2", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "loongforge.diffusion.cli", "preprocess", f"output={tmp_path / 'two'}", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert main(["preprocess", f"output={tmp_path / 'one'}", *args]) == 0  # meanwhile, one process
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert output.count("manifest.json") == 1  # written once, by rank 0
    one, two = LatentShards(tmp_path / "one"), LatentShards(tmp_path / "two")
    assert len(two) == len(one) == 5 and len(two.manifest["shards"]) == 3
    for i in range(5):
        for a, b in zip(two.load(i), one.load(i)):
            torch.testing.assert_close(a, b)


def test_a_rank_without_a_process_group_is_refused(setup, monkeypatch):
    cfg, _, _ = setup
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but this process has joined no process group"):
        preprocess(cfg)


@pytest.mark.slow
def test_image_condition_and_clip_tokens_reload_to_encoder_outputs(setup, tmp_path):
    """``image_condition=true`` stores each sample's I2V condition latents (its first frame then
    blank frames, VAE-encoded) and ``image_encoder=DIR`` its first frame's CLIP tokens; and the
    causal VAE's first latent frame of a clip is its first frame encoded alone (what TI2V trains on)."""
    from loongforge.diffusion.conditioning import blank_after_first
    from loongforge.diffusion.data.encoders import encode_images, load_image_encoder

    cfg, clips, encoders = setup
    cfg.output, cfg.image_condition, cfg.image_encoder = str(tmp_path / "i2v"), True, str(encoders)
    preprocess(cfg)
    data = LatentShards(cfg.output)
    assert data.manifest["image_condition"] is True and data.manifest["image_dim"] == 32
    rows = [json.loads(line) for line in (clips / "metadata.jsonl").read_text().splitlines()]
    vae = load_vae(encoders, "cpu")
    processor, clip = load_image_encoder(encoders, "cpu")
    for i, row in enumerate(rows[:3]):  # an image and two videos
        latents, _ = data.load(i)
        stored = data.load_condition(i)
        video = to_model_input(read_frames(clips / row["file_name"], 9), 48 * 48, 16, 4)
        condition = encode_video(vae, blank_after_first(video))
        torch.testing.assert_close(stored["condition"], condition)
        assert stored["condition"].shape == latents.shape
        (tokens,) = encode_images(processor, clip, [video[:, 0]])
        torch.testing.assert_close(stored["image"], tokens)
        assert stored["image"].shape == (5, 32)
        torch.testing.assert_close(latents[:, :1], encode_video(vae, video[:, :1]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(condition[:, :1], latents[:, :1], atol=1e-5, rtol=1e-5)
