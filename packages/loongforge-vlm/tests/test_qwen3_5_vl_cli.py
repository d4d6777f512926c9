"""``lf-vlm`` with Qwen3.5 compositions: the debug config trains on the shipped shapes set and
exports to transformers' ``Qwen3_5ForConditionalGeneration`` (``Qwen3_5MoeForConditionalGeneration``
with the MoE foundation); a transformers Qwen3.5 converted by ``lf-vlm convert`` trains from the
``train.yaml`` it writes; the real-size config counts the parameters transformers builds."""

import json
import math

import pytest
import torch

FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "log.interval=1", "log.progress=false",
        "log.tensorboard=false"]


def losses_of(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def manifest(run) -> dict:
    root = run / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "manifest.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("foundation", ["qwen3_5_debug", pytest.param("qwen3_5_moe_debug", marks=pytest.mark.long)])
def test_qwen3_5_vl_debug_trains_and_exports(foundation, tmp_path, vlm_cache):
    """``lf-vlm train --config qwen3_5_vl_debug`` (no DeepStack, Gated DeltaNet and gated attention,
    interleaved mRoPE on a quarter of each head, THD rows), then ``lf-vlm convert lf-to-hf``:
    transformers loads the trained weights (the MoE foundation: ~1 min, in the long tier)."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    from loongforge.vlm.cli import main

    run = tmp_path / "run"
    assert main(["train", "--config", "qwen3_5_vl_debug", f"foundation={foundation}", *FAST, "train.steps=3",
                 f"data.cache_dir={vlm_cache}", f"log.run_dir={run}"]) == 0
    losses = losses_of(run)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    parts = manifest(run)["model_config"]
    assert parts["encoder"]["family"] == "qwen3_vit" and parts["encoder"]["deepstack_layers"] == []
    assert parts["foundation"]["family"] == foundation.removesuffix("_debug")
    assert parts["vision"] == {**parts["vision"], "rope": "mrope_interleaved", "mrope_section": [2, 1, 1]}
    assert main(["convert", "lf-to-hf", str(run / "checkpoints"), str(tmp_path / "out"), "--no-progress"]) == 0
    moe = foundation == "qwen3_5_moe_debug"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"]
    assert config["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.25
    model = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    exported = model.from_pretrained(tmp_path / "out").state_dict()
    assert any(".linear_attn." in k for k in exported) and all(torch.isfinite(t).all() for t in exported.values())


@pytest.mark.slow
def test_convert_qwen3_5_then_train_from_the_written_config(tmp_path, vlm_cache):
    """HF Qwen3.5 dir -> ``lf-vlm convert hf-to-lf`` -> ``lf-vlm train --config OUT/train.yaml``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from loongforge.vlm.cli import main
    from loongforge.vlm.data.tokenizer import load_vlm_tokenizer

    _, ids = load_vlm_tokenizer()
    text = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, out_hidden_size=64,
                  num_position_embeddings=16)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=ids.image, video_token_id=ids.video,
        vision_start_token_id=ids.start, vision_end_token_id=ids.end)).save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-lf", str(tmp_path / "hf"), str(tmp_path / "lf"), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "lf" / "train.yaml"), *FAST, "train.steps=2",
                 "train.seq_length=512", f"data.cache_dir={vlm_cache}", f"log.run_dir={run}"]) == 0
    losses = losses_of(run)
    assert len(losses) == 2 and 5.0 < losses[0] < 9.0  # from the converted (random-init) weights: about ln(1280)
    parts = manifest(run)["model_config"]
    assert parts["foundation"]["family"] == "qwen3_5" and parts["encoder"]["deepstack_layers"] == []


def test_real_size_config_counts_what_transformers_builds():
    """``lf-vlm info``'s parameter count of ``qwen3_5_vl_0_8b`` equals transformers' model of its
    exported ``config.json`` (built on the meta device)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.hf import config_to_hf

    cfg = load_vlm_config("qwen3_5_vl_0_8b", ["vision.image_token_id=248056", "vision.video_token_id=248057"]).model()
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config.from_dict(config_to_hf(cfg)))
    assert sum(cfg.parameter_counts().values()) == sum(p.numel() for p in hf.parameters())
    assert hf.config.text_config.layer_types.count("full_attention") == 6


def test_bad_qwen3_5_vl_config_is_one_clear_error(capsys):
    from loongforge.vlm.cli import main

    assert main(["info", "--config", "qwen3_5_vl_debug", "vision.mrope_section=[11,11,10]"]) == 2
    assert ("vision.mrope_section=[11, 11, 10] sums to 32; the foundation's 8 rotated dims per head need 4"
            in capsys.readouterr().err)
