"""InternVL3.5 through ``lf-vlm``: the debug config trains on the shipped set (images as tiles
plus a thumbnail) and exports a directory transformers' ``InternVLForConditionalGeneration``
loads; the released-size config counts what transformers builds; bad keys are one error line."""

import json
import math

import pytest
import torch

FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "log.interval=1", "log.progress=false",
        "log.tensorboard=false"]


@pytest.mark.slow
def test_internvl3_5_debug_trains_and_exports(tmp_path, vlm_cache):
    from transformers import InternVLForConditionalGeneration

    from loongforge.vlm.cli import main

    run = tmp_path / "run"
    assert main(["train", "--config", "internvl3_5_debug", *FAST, "train.steps=3", f"data.cache_dir={vlm_cache}",
                 f"log.run_dir={run}"]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert main(["convert", "lf-to-hf", str(run / "checkpoints"), str(tmp_path / "out"), "--no-progress"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["InternVLForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen3" and config["image_seq_length"] == 4
    exported = InternVLForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.isfinite(t).all() for t in exported.values())


def test_released_config_counts_what_transformers_builds():
    """``lf-vlm info --config internvl3_5_8b``'s parameter count equals transformers' model of its
    exported ``config.json`` (on the meta device): about 8.5B (InternViT-300M + Qwen3-8B)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.hf import config_to_hf

    cfg = load_vlm_config("internvl3_5_8b", ["vision.image_token_id=151671", "vision.video_token_id=151671"]).model()
    with torch.device("meta"):
        hf = InternVLForConditionalGeneration(InternVLConfig.from_dict(config_to_hf(cfg)))
    total = sum(cfg.parameter_counts().values())
    assert total == sum(p.numel() for p in hf.parameters())
    assert 8.4e9 < total < 8.6e9
    assert hf.config.image_seq_length == 256


def test_bad_internvl_config_is_one_clear_error(capsys):
    from loongforge.vlm.cli import main

    assert main(["info", "--config", "internvl3_5_debug", "encoder.norm=batchnorm"]) == 2
    assert "encoder.norm='batchnorm': one of layernorm, rmsnorm" in capsys.readouterr().err
    assert main(["info", "--config", "internvl3_5_debug", "encoder.image_size=36"]) == 2
    assert "encoder.image_size=36: must be a multiple of" in capsys.readouterr().err
    assert main(["info", "--config", "internvl3_5_debug", "data.media.max_tiles=0"]) == 2
    assert "data.media: tile_size=32, min_tiles=1, max_tiles=0" in capsys.readouterr().err


@pytest.mark.slow
def test_convert_internvl_then_train_from_the_written_config(tmp_path, vlm_cache):
    """HF InternVL dir -> ``lf-vlm convert hf-to-lf`` -> ``lf-vlm train --config OUT/train.yaml``:
    the written config tiles images and writes InternVL's placeholders."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from loongforge.vlm.cli import main
    from loongforge.vlm.data.tokenizer import load_vlm_tokenizer

    tokenizer, ids = load_vlm_tokenizer(placeholders="internvl")
    assert ids.image == ids.video == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    text = dict(model_type="qwen3", vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8, attention_bias=True)
    InternVLForConditionalGeneration(InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids.image,
                                                    tie_word_embeddings=False)).save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-lf", str(tmp_path / "hf"), str(tmp_path / "lf"), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "lf" / "train.yaml"), *FAST, "train.steps=2",
                 "train.seq_length=512", f"data.cache_dir={vlm_cache}", f"log.run_dir={run}"]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and 5.0 < losses[0] < 9.0  # from the converted (random-init) weights: about ln(1280)
    written = (tmp_path / "lf" / "train.yaml").read_text()
    assert "tile_size: 32" in written and "placeholders: internvl" in written


@pytest.mark.slow
def test_lora_on_layer_scaled_linears_is_refused(tmp_path, vlm_cache, capsys):
    from loongforge.vlm.cli import main

    assert main(["train", "--config", "internvl3_5_debug", *FAST, "train.steps=1", "lora.rank=4",
                 "lora.target_modules=[encoder.linear_proj]", f"data.cache_dir={vlm_cache}",
                 f"log.run_dir={tmp_path / 'run'}"]) == 2
    assert "a layer-scaled output linear whose adapter would add after the scale" in capsys.readouterr().err
    assert main(["train", "--config", "internvl3_5_debug", *FAST, "train.steps=1", "lora.rank=4",
                 "lora.target_modules=[encoder.linear_qkv,foundation.linear_qkv]", f"data.cache_dir={vlm_cache}",
                 f"log.run_dir={tmp_path / 'run2'}"]) == 0
