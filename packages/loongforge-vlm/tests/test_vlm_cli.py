"""``lf-vlm`` end to end on the shipped shapes set: training, exact resume, and swapping a part of
the composition by changing one line of the config."""

import json
from pathlib import Path

import pytest

from loongforge.vlm.recipe import CONFIG_DIR

FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "log.interval=1", "log.progress=false",
        "log.tensorboard=false"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def manifest(run_dir: Path) -> dict:
    root = run_dir / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "manifest.json").read_text())


@pytest.mark.slow
def test_train_end_to_end_and_exact_resume(tmp_path, vlm_cache):
    from cli_runner import run_cli

    first = tmp_path / "first"
    proc = run_cli(["lf-vlm", "train", *FAST, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=2",
                    f"data.cache_dir={vlm_cache}", f"log.run_dir={first}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ref = metrics(first)
    assert [m["step"] for m in ref] == [1, 2, 3, 4]
    assert ref[-1]["loss"] < ref[0]["loss"]
    record = manifest(first)
    assert record["family"] == "vlm" and record["model_config"]["encoder"]["family"] == "qwen2_5_vit"

    # resume from the step-2 checkpoint of the first run: steps 3 and 4 again, bit for bit
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step_00000002").symlink_to(first / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    proc = run_cli(["lf-vlm", "train", *FAST, "train.steps=4", "checkpoint.save=false",
                    f"data.cache_dir={vlm_cache}", f"log.run_dir={resumed}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    again = metrics(resumed)
    assert [m["step"] for m in again] == [3, 4]
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in ref[2:]], rel=1e-6)
    assert [m["grad_norm"] for m in again] == pytest.approx([m["grad_norm"] for m in ref[2:]], rel=1e-6)


SWAPS = {
    "foundation-llama": ("  - foundation: qwen2_debug", "  - foundation: llama_debug"),
    "foundation-qwen3": ("  - foundation: qwen2_debug", "  - foundation: qwen3_debug"),
    "encoder-siglip": ("  - encoder: qwen2_5_vit_debug\n  - projector: patch_merge_mlp",
                       "  - encoder: siglip_vit_debug\n  - projector: mlp_2x"),
}


@pytest.mark.slow
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_changing_one_line_swaps_the_part_and_trains(swap, tmp_path, vlm_cache):
    from loongforge.vlm.cli import main

    old, new = SWAPS[swap]
    text = (CONFIG_DIR / "vlm_debug.yaml").read_text()
    assert old in text
    config = tmp_path / "vlm.yaml"
    config.write_text(text.replace(old, new))
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), *FAST, "train.steps=3", f"data.cache_dir={vlm_cache}",
                 f"log.run_dir={run}"]) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    parts = manifest(run)["model_config"]
    expected = {"foundation-llama": ("llama", "qwen2_5_vit"), "foundation-qwen3": ("qwen3", "qwen2_5_vit"),
                "encoder-siglip": ("qwen2", "siglip_vit")}[swap]
    assert (parts["foundation"]["family"], parts["encoder"]["family"]) == expected


def test_bad_config_is_one_clear_error(capsys):
    from loongforge.vlm.cli import main

    assert main(["train", "parallel.tp=2", "parallel.encoder.tp=4"]) == 2
    assert "parallel.encoder.tp=4: must be 1 or parallel.tp=2" in capsys.readouterr().err
    assert main(["train", "trainable=[projector,decoder]"]) == 2
    assert "trainable=['projector', 'decoder']" in capsys.readouterr().err
    assert main(["train", "parallel.ep=2"]) == 2
    assert "parallel.ep=2: the VLM recipe runs the foundation with tensor, pipeline, context and data" \
        in capsys.readouterr().err
    assert main(["train", "foundation=qwen3_moe_debug", "parallel.cp=2"]) == 2
    assert "parallel.cp=2: the VLM's context parallelism needs the foundation on loongforge-llm's fast layer" \
        in capsys.readouterr().err
    assert main(["train", "parallel.encoder.decoupled=true", "train.overlap_grad_reduce=true"]) == 2
    assert "parallel.encoder.decoupled=true with train.overlap_grad_reduce=true" in capsys.readouterr().err


def test_unsupported_pipeline_is_one_clear_error(capsys):
    """What the VLM's pipeline (parallel.pp>1) cannot run fails as a config error, before any process group;
    together with context parallelism it runs (test_vlm_parallel's PP=2 x CP=2 case)."""
    from loongforge.vlm.cli import load_vlm_config, main

    cfg = load_vlm_config("vlm_debug", ["parallel.cp=2", "parallel.pp=2"])
    assert (cfg.parallel.pp, cfg.parallel.cp) == (2, 2)
    assert main(["train", "parallel.pp=3"]) == 2
    assert "parallel.pp=3: foundation.num_layers=2 does not split into 3 stages" in capsys.readouterr().err
    # qwen3_debug has 2 layers: the first stage holds layer 0 only, DeepStack's second feature is for layer 1
    assert main(["train", "--config", "qwen3_vl_debug", "parallel.pp=2", "encoder.deepstack_layers=[0,1]"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp=2 with encoder.deepstack_layers=[0, 1]: DeepStack adds its 2 features to foundation " \
           "layers 0..1, but the first pipeline stage (which holds the vision tower) has layers 0..0" in err
    assert main(["train", "foundation=qwen3_moe_debug", "foundation.moe_token_dispatcher=allgather",
                 "parallel.pp=2"]) == 2
    assert "parallel.pp=2 with foundation.moe_token_dispatcher=allgather" in capsys.readouterr().err


def test_bad_qwen3_vl_config_is_one_clear_error(capsys):
    from loongforge.vlm.cli import main

    assert main(["train", "--config", "qwen3_vl_debug", "train.recompute=full"]) == 2
    assert "train.recompute=full with encoder.deepstack_layers=[0]" in capsys.readouterr().err
    assert main(["info", "--config", "qwen3_vl_debug", "encoder.deepstack_layers=[1,0]"]) == 2
    assert "encoder.deepstack_layers=[1, 0]: increasing layer indices in 0..1" in capsys.readouterr().err
    assert main(["info", "--config", "qwen3_vl_debug", "encoder.num_position_embeddings=15"]) == 2
    assert "encoder.num_position_embeddings=15: must be a square number" in capsys.readouterr().err


@pytest.mark.slow
def test_convert_train_from_hf_and_export(tmp_path, vlm_cache):
    """HF Qwen2.5-VL dir -> ``lf-vlm convert`` -> train from it with the written config ->
    export the trained checkpoint -> transformers loads it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from loongforge.vlm.cli import main
    from loongforge.vlm.data.tokenizer import load_vlm_tokenizer

    _, ids = load_vlm_tokenizer()  # the bundled tokenizer the converted config trains with
    text = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, window_size=32,
                  out_hidden_size=64, fullatt_block_indexes=[1], tokens_per_second=2)
    hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids.image, video_token_id=ids.video,
        vision_start_token_id=ids.start, vision_end_token_id=ids.end))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-lf", str(tmp_path / "hf"), str(tmp_path / "lf"), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "lf" / "train.yaml"), *FAST, "train.steps=2",
                 "train.seq_length=512", f"data.cache_dir={vlm_cache}", f"log.run_dir={run}",
                 "--save-hf", str(tmp_path / "saved")]) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 2 and 5.0 < losses[0] < 9.0  # from the converted (random-init) weights: about ln(1280)
    assert main(["convert", "lf-to-hf", str(run / "checkpoints"), str(tmp_path / "out"), "--no-progress"]) == 0
    trained = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out")
    before, after = hf.state_dict(), trained.state_dict()
    assert sorted(before) == sorted(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the exported weights are the trained ones
    saved = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "saved").state_dict()  # train --save-hf
    assert sorted(saved) == sorted(after) and all(torch.equal(saved[k], after[k]) for k in after)


@pytest.mark.slow
@pytest.mark.parametrize("foundation", ["qwen3_debug", "qwen3_moe_debug"])
def test_qwen3_vl_debug_trains_and_exports(foundation, tmp_path, vlm_cache):
    """``lf-vlm train --config qwen3_vl_debug`` (DeepStack, interleaved mRoPE; a dense or MoE
    foundation) on the shipped set, then ``lf-vlm convert lf-to-hf``: transformers' Qwen3-VL
    (Qwen3-VL-MoE) loads the trained weights."""
    import math

    import torch
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    from loongforge.vlm.cli import main

    run = tmp_path / "run"
    assert main(["train", "--config", "qwen3_vl_debug", f"foundation={foundation}", *FAST, "train.steps=3",
                 f"data.cache_dir={vlm_cache}", f"log.run_dir={run}"]) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    parts = manifest(run)["model_config"]
    assert parts["encoder"]["family"] == "qwen3_vit" and parts["vision"]["rope"] == "mrope_interleaved"
    assert parts["foundation"]["family"] == foundation.removesuffix("_debug")
    assert main(["convert", "lf-to-hf", str(run / "checkpoints"), str(tmp_path / "out"), "--no-progress"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [f"Qwen3VL{'Moe' if 'moe' in foundation else ''}ForConditionalGeneration"]
    model = Qwen3VLMoeForConditionalGeneration if foundation == "qwen3_moe_debug" else Qwen3VLForConditionalGeneration
    exported = model.from_pretrained(tmp_path / "out").state_dict()
    deepstack = [k for k in exported if k.startswith("model.visual.deepstack_merger_list.")]
    assert len(deepstack) == 6 and all(torch.isfinite(exported[k]).all() for k in exported)


@pytest.mark.slow
def test_convert_qwen3_vl_then_train_from_the_written_config(tmp_path, vlm_cache):
    """HF Qwen3-VL dir -> ``lf-vlm convert hf-to-lf`` -> ``lf-vlm train --config OUT/train.yaml``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from loongforge.vlm.cli import main
    from loongforge.vlm.data.tokenizer import load_vlm_tokenizer

    _, ids = load_vlm_tokenizer()
    text = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids.image, video_token_id=ids.video,
        vision_start_token_id=ids.start, vision_end_token_id=ids.end)).save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-lf", str(tmp_path / "hf"), str(tmp_path / "lf"), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "lf" / "train.yaml"), *FAST, "train.steps=2",
                 "train.seq_length=512", f"data.cache_dir={vlm_cache}", f"log.run_dir={run}"]) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 2 and 5.0 < losses[0] < 9.0  # from the converted (random-init) weights: about ln(1280)
    parts = manifest(run)["model_config"]
    assert parts["encoder"]["deepstack_layers"] == [0] and parts["vision"]["rope"] == "mrope_interleaved"
