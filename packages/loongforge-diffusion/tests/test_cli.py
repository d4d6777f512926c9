"""`lf-diffusion train` / `sample` / `convert` end to end on CPU, and exact resume."""

import json

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from PIL import Image

from loongforge.core.checkpoint import load_checkpoint
from loongforge.core.metrics import read_metrics
from loongforge.diffusion.cli import main
from loongforge.diffusion.data.shards import LatentShards
from loongforge.diffusion.model.convert import read_diffusers_weights


def test_train_then_sample_then_convert(tmp_path, synthetic_overrides, builtin_latents):
    run = tmp_path / "run"
    assert main(["train", f"log.run_dir={run}", "train.steps=30", "checkpoint.interval=15", *synthetic_overrides]) == 0

    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 31))
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    assert all(np.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0 for r in records)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert (run / "checkpoints" / "step_00000015").is_dir()

    assert main(["sample", "--run", str(run), "sample.num_steps=4", "sample.num_samples=3"]) == 0
    png, gif = run / "samples" / "step_00000030.png", run / "samples" / "step_00000030.gif"
    sheet = np.asarray(Image.open(png))
    videos = [LatentShards(builtin_latents).records[i]["video_shape"] for i in range(3)]  # [3, F, H, W]
    frames, height, width = (max(v[k] for v in videos) for k in (1, 2, 3))
    assert frames == 9
    # 3 generated + 3 reference strips of their frames, 2 px gaps
    assert sheet.shape == (6 * (height + 2), frames * (width + 2), 3) and sheet.std() > 1.0
    with Image.open(gif) as anim:
        assert anim.n_frames == frames

    # new prompts through the dataset's text encoder, with classifier-free guidance
    assert main(["sample", "--run", str(run), "--out", str(tmp_path / "prompted"), "sample.num_steps=3",
                 "sample.prompts=[a red circle moving left on a black background]", "sample.guidance_scale=3.0",
                 "sample.num_frames=5", "sample.height=32", "sample.width=48"]) == 0
    prompted = np.asarray(Image.open(tmp_path / "prompted" / "step_00000030.png"))
    assert prompted.shape == (32 + 2, 5 * (48 + 2), 3)

    out = tmp_path / "hf"
    assert main(["convert", "lf-to-diffusers", str(run), str(out), "--ema"]) == 0
    tensors, manifest, _ = load_checkpoint(run / "checkpoints")
    assert manifest["family"] == "wan" and manifest["ema"] is True
    exported = read_diffusers_weights(out)
    assert json.loads((out / "config.json").read_text())["num_layers"] == 2
    for key, value in exported.items():
        assert torch.equal(value, tensors[f"ema.transformer.{key}"]), key
    loaded = WanTransformer3DModel.from_pretrained(str(out))  # the export is a diffusers checkpoint
    assert set(loaded.state_dict()) == set(exported)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, exported[key]), key


@pytest.mark.parametrize("fp8", ["none", "tensorwise"])  # FP8 scales are current: nothing to carry over
def test_resume_continues_exactly(tmp_path, synthetic_overrides, fp8):
    common = ["train.steps=4", "train.global_batch_size=4", "ema.decay=0.5", f"model.fp8={fp8}", *synthetic_overrides]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", f"log.run_dir={straight}", *common]) == 0
    assert main(["train", f"log.run_dir={resumed}", "train.exit_interval=2", *common]) == 0
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert main(["train", f"log.run_dir={resumed}", *common]) == 0

    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ta, ma, _ = load_checkpoint(straight / "checkpoints")
    tb, mb, _ = load_checkpoint(resumed / "checkpoints")
    assert ma["step"] == mb["step"] == 4 and set(ta) == set(tb)
    assert any(k.startswith("optim.") for k in ta) and any(k.startswith("ema.") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_one_expert_of_two_trains_and_the_other_stays(tmp_path, synthetic_overrides):
    """Wan 2.2 layout: model.train_expert=transformer_2 updates only the low-noise expert (EMA too)."""
    from loongforge.diffusion.model import WanConfig, WanExperts

    run = tmp_path / "run"
    assert main(["train", f"log.run_dir={run}", "model.boundary_ratio=0.875", "model.train_expert=transformer_2",
                 "train.steps=2", "train.global_batch_size=4", *synthetic_overrides]) == 0
    assert {r["expert"] for r in read_metrics(run)} == {1.0}
    tensors, manifest, _ = load_checkpoint(run / "checkpoints")
    assert manifest["experts"] == ["transformer", "transformer_2"]
    torch.manual_seed(1234)  # train.seed: the initial weights of both experts
    init = WanExperts(WanConfig(boundary_ratio=0.875)).state_dict()
    for key, value in init.items():
        saved = tensors[f"model.{key}"]
        if key.startswith("transformer."):
            assert torch.equal(saved, value), key
    assert not torch.equal(tensors["model.transformer_2.proj_out.weight"], init["transformer_2.proj_out.weight"])
    assert {k.split(".")[1] for k in tensors if k.startswith(("ema.", "optim."))} == {"transformer_2"}


def test_bench_and_info_run(capsys):
    from loongforge.diffusion.cli import load_recipe

    size = ["sample.num_frames=5", "sample.height=32", "sample.width=48"]
    preset = load_recipe(None, size).train.recompute
    assert main(["bench", "--steps", "1", "--warmup", "1", "--variant", "v1=train.recompute=selective",
                 "--variant", "v2=model.fp8=tensorwise", *size]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "12 tokens/step" in out  # 2 latent frames x 2 x 3 patches
    rows = [line for line in out.splitlines() if "tokens/s " in line]
    headline = ["diffusers", "loongforge"] + (["loongforge_preset"] if preset not in ("none", "full") else [])
    assert [r.split(":")[0].strip() for r in rows] == [*headline, "v1", "v2"]
    assert all("peak" in r and "first loss" in r and "last" in r for r in rows)
    assert "recompute=selective" in out and "MISMATCH" not in out
    # two rounds, alternating which side runs first
    assert f"round 1 of 2: diffusers, {', '.join(headline[1:])}" in out
    assert f"round 2 of 2: {', '.join(headline[1:])}, diffusers" in out
    assert "compile_repeated_blocks = True" in out and "fused_adamw = True  (requested; CUDA only" in out
    assert main(["bench", "--variant", "v=train.recompute=sometimes", *size]) == 2
    assert "train.recompute='sometimes'" in capsys.readouterr().err
    assert main(["info", "model=wan2_1_t2v_1_3b"]) == 0
    assert "parameters per part: 1419.00M" in capsys.readouterr().out  # Wan 2.1 T2V 1.3B


def test_bench_ours_is_the_trainers_step(tmp_path):
    """The bench's ours is ``Trainer.train_step`` of ``FlowMatchingTask`` (the torch engine lf-diffusion
    train builds): one call trains one step, and its loss is the packed model's MSE on the bench's
    batch from the shared initial weights."""
    import torch.nn.functional as F

    from loongforge.core.bench_protocol import bench_run_config, bench_world
    from loongforge.diffusion.bench import Bench
    from loongforge.diffusion.cli import load_recipe
    from loongforge.diffusion.model import WanDiT

    recipe = load_recipe(None, ["sample.num_frames=5", "sample.height=32", "sample.width=48"])
    bench = Bench(recipe, steps=1, warmup=1)
    with bench_world(recipe.train.seed) as ctx:
        step, trainer = bench.ours_step(bench_run_config(recipe, str(tmp_path)), ctx)
        loss = step()
    assert trainer.step == 1 and trainer.engine.name == "torch"
    model = WanDiT(recipe.model)
    model.load_state_dict(bench.initial_state)
    with torch.no_grad():
        expected = F.mse_loss(model(bench.batch), bench.packed_target)
    assert loss == pytest.approx(float(expected), rel=1e-5)
    assert not any(tmp_path.iterdir())  # no checkpoint, no record: the bench's trainer only steps


def test_bench_harness_step_is_lf_diffusion_train_step(tmp_path, synthetic_overrides):
    """The harness's ours (``training_step``: the task's trainer on the task's own first step) is
    lf-diffusion train's step: from the same config and seed its first-step loss is the one the
    training run logs for step 1."""
    from loongforge.core.bench_protocol import bench_run_config, bench_world, training_step
    from loongforge.diffusion.cli import DEFAULT_TRAIN, load_recipe, make_task

    overrides = [*synthetic_overrides, "train.steps=1", "checkpoint.save=false", "log.tensorboard=false"]
    assert main(["train", *overrides, f"log.run_dir={tmp_path / 'run'}"]) == 0
    logged = [r for r in read_metrics(tmp_path / "run") if r.get("step") == 1]
    recipe = bench_run_config(load_recipe(DEFAULT_TRAIN, overrides), str(tmp_path / "bench"))
    with bench_world(recipe.train.seed) as ctx:
        step, _ = training_step(make_task(recipe), ctx, recipe)
        assert step() == logged[0]["loss"]


@pytest.mark.parametrize(("config", "side", "tokens"), [("bench_wan2_1_t2v_1_3b", 32, 8), ("bench_wan2_2_ti2v_5b", 64, 8)])
def test_shipped_bench_cases_run_cut_down(config, side, tokens, capsys):
    """The shipped bench cases (whole Wan 2.1 1.3B; Wan 2.2 TI2V 5B's transformer text-to-video,
    its latents through the 16x VAE) run against diffusers, cut down to one small layer on CPU; their
    full shapes are the configs' (2 latent frames x 2 x 2 patches here: the 5B's side of 64 px is
    4 latents through its VAE, the 1.3B's 32 px through Wan 2.1's)."""
    from loongforge.diffusion.cli import load_recipe

    full = load_recipe(config, [])
    assert full.model.num_layers == 30 and full.train.recompute == "full" and full.model.condition == "none"
    cut = ["model.num_layers=1", "model.num_attention_heads=2", "model.attention_head_dim=16", "model.ffn_dim=64",
           "model.text_dim=32", "model.text_len=8", "model.freq_dim=32", "sample.num_frames=5",
           f"sample.height={side}", f"sample.width={side}"]
    assert main(["bench", "--config", config, "--steps", "1", "--warmup", "1", "--rounds", "1", "--profile-rows", "0",
                 *cut]) == 0
    out = capsys.readouterr().out
    assert f"{tokens} tokens/step, 1 layers" in out and "speed-up (diffusers" in out and "MISMATCH" not in out


@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_bench_baseline_recipe_is_diffusers_gpu_training_with_our_checkpointing(recompute):
    from loongforge.diffusion.bench import diffusers_recipe, headline_recipe, headline_recompute
    from loongforge.diffusion.cli import load_recipe

    recipe = load_recipe(None, [f"train.recompute={recompute}"])
    baseline = diffusers_recipe(recipe)
    assert dict(baseline.options) == {"attention": "sdpa", "compile_repeated_blocks": True, "fused_adamw": True,
                                      "tf32": True, "autocast": "bfloat16",
                                      "gradient_checkpointing": recompute != "none"}
    assert baseline.applied("cuda") == dict(baseline.options)
    # the headline row checkpoints exactly when diffusers does: whole blocks, train.recompute=full
    assert headline_recompute(recipe) == ("full" if recompute != "none" else "none")
    # and keeps no EMA weights, as diffusers' step (a config's ema.decay stays its preset run's)
    with_ema = load_recipe(None, [f"train.recompute={recompute}", "ema.decay=0.99"])
    assert headline_recipe(with_ema).ema.decay == 0 and with_ema.ema.decay == 0.99
    assert headline_recipe(with_ema).train.recompute == headline_recompute(recipe)


def test_bench_runs_image_to_video_against_diffusers(capsys):
    """An I2V config (mask and condition latents on channels, CLIP tokens in the cross-attention)
    benches against diffusers on the same conditioned inputs (first-step losses checked inside);
    TI2V, and an I2V prompt length diffusers' attention would split wrongly, are refused by key."""
    size = ["sample.num_frames=5", "sample.height=32", "sample.width=32"]
    assert main(["bench", "--config", "tiny_i2v", "--steps", "1", "--warmup", "1", "--rounds", "1",
                 "model.text_len=512", *size]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "MISMATCH" not in out and "8 tokens/step" in out  # 2 latent frames x 2 x 2
    assert main(["bench", "--config", "tiny_i2v", *size]) == 2
    assert "model.text_len=16" in capsys.readouterr().err
    assert main(["bench", "--config", "tiny_ti2v", *size]) == 2
    assert "model.condition='ti2v'" in capsys.readouterr().err


def test_bench_refuses_a_variant_named_as_a_headline_run(capsys):
    assert main(["bench", "--variant", "loongforge_preset=train.recompute=none"]) == 2
    assert "give it a name of its own" in capsys.readouterr().err


@pytest.mark.parametrize("flavour", ["i2v", "ti2v"])
def test_image_to_video_debug_configs_train_sample_from_an_image_and_export(tmp_path, synthetic_overrides,
                                                                            builtin_latents, flavour, capsys):
    """`--config tiny_i2v` / `tiny_ti2v` train on the built-in set (I2V reads its stored condition
    latents and CLIP tokens, TI2V the clips' first latent frames), sample from an image file, and
    export a diffusers checkpoint of the image-conditioned architecture."""
    run = tmp_path / "run"
    assert main(["train", "--config", f"tiny_{flavour}", f"log.run_dir={run}", "train.steps=3",
                 "train.global_batch_size=4", *synthetic_overrides]) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)

    image = tmp_path / "start.png"
    Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8)[None, :, None], (40, 1, 3))).save(image)
    out = tmp_path / "from_image"
    assert main(["sample", "--run", str(run), "--out", str(out), "--image", str(image), "sample.num_steps=2",
                 "sample.num_frames=5", "sample.height=32", "sample.width=48",
                 "sample.prompts=[a red circle moving left on a black background, a blue square]"]) == 0
    sheet = np.asarray(Image.open(out / "step_00000003.png"))
    assert sheet.shape == (2 * (32 + 2), 5 * (48 + 2), 3)  # two videos of 5 frames, no reference row
    with Image.open(out / "step_00000003.gif") as anim:
        assert anim.n_frames == 5
    # without an image: the dataset samples' own first frames, their decoded latents as reference
    assert main(["sample", "--run", str(run), "--out", str(tmp_path / "own"), "sample.num_steps=2",
                 "sample.num_samples=2"]) == 0
    assert (tmp_path / "own" / "step_00000003.png").is_file()
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "sample.prompts=[a]"]) == 2
    assert "need sample.image=PATH" in capsys.readouterr().err
    assert main(["sample", "--run", str(run), "--image", str(tmp_path / "missing.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.png" in err[0] and "no such file" in err[0]
    assert main(["sample", "--run", str(run), "--image", str(image), "sample.height=40"]) == 2
    assert "sample.height=40 and sample.width=32 must be multiples of 16" in capsys.readouterr().err

    hf = tmp_path / "hf"
    assert main(["convert", "lf-to-diffusers", str(run), str(hf)]) == 0
    loaded = WanTransformer3DModel.from_pretrained(str(hf))
    tensors, _, _ = load_checkpoint(run / "checkpoints")
    assert loaded.config.image_dim == (32 if flavour == "i2v" else None)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, tensors[f"model.transformer.{key}"]), key
    half = tmp_path / "hf-bf16"  # --dtype casts the exported weights
    assert main(["convert", "lf-to-diffusers", str(run), str(half), "--dtype", "bf16"]) == 0
    from safetensors.torch import load_file

    written = {k: v for f in sorted(half.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(written) == sorted(loaded.state_dict())
    for key, value in written.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, tensors[f"model.transformer.{key}"].bfloat16()), key


def test_image_to_video_data_mismatches_are_one_error_line(tmp_path, builtin_latents, capsys):
    """An I2V model on data without condition latents, or with CLIP tokens of another width, stops
    before training with one line naming the manifest and the key."""
    import shutil

    data = tmp_path / "latents"
    shutil.copytree(builtin_latents, data)
    common = ["train", "--config", "tiny_i2v", f"log.run_dir={tmp_path / 'run'}", "log.progress=false"]
    capsys.readouterr()
    assert main([*common, f"data.path={data}", "model.image_dim=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json: image_dim=32" in err[0] and "model.image_dim=16" in err[0]
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "image_condition": False}))
    assert main([*common, f"data.path={data}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json: no I2V condition latents" in err[0] and "image_condition=true" in err[0]
