"""SigLIP's vision tower against transformers' ``SiglipVisionModel``.

A tiny random SigLIP tower (2 layers, 32 wide, 2 heads, 8x8 patches, 32x32 images so a learned
4x4 position grid, an attention-pooling head) is saved with ``save_pretrained`` and loaded into
the ``siglip_vit`` encoder through ``hf_siglip`` (the table, the online sharded reader). Our patch
features equal transformers' ``last_hidden_state`` (fp32, atol 1e-5) at the native grid and, with
``interpolate_pos_encoding=True``, at other grids (both resample the table bicubically without
aligned corners); LLaVA-OneVision's tower (its projector reads the last layer before
``post_layernorm``) equals its ``hidden_states[-1]``. Saving the encoder back gives a directory
transformers loads with bitwise the original tower; a stray tensor or an architecture the
encoder's config does not have is one error naming it.
"""

import json

import numpy as np
import pytest
import torch
from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipConfig, SiglipModel,
                          SiglipVisionConfig, SiglipVisionModel)

from loongforge.core.config import ConfigError
from vlm_hf_cases import randomize_

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8, layer_norm_eps=1e-6)
NORMS = ("layer_norm", "layernorm")


def encoder_config(**changes):
    from loongforge.vlm.encoders.siglip_vit import SigLIPViTConfig

    settings = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, patch_size=8,
                    image_size=32, spatial_merge_size=1)
    return SigLIPViTConfig(**{**settings, **changes})


def build(cfg, megatron_world):
    from megatron.core.transformer import TransformerConfig

    from loongforge.vlm.encoders import build_encoder
    from loongforge.vlm.encoders.layers import encoder_transformer_config

    foundation = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)
    return build_encoder(cfg, encoder_transformer_config(cfg, 1, "none", foundation), megatron_world.pgs).eval()


def patches(image: torch.Tensor):
    """transformers' ``[1, 3, H, W]`` image -> our flattened patches and ``grid_thw``."""
    from loongforge.vlm.data.media import PatchGeometry, patchify

    flat, grid = patchify(image.numpy(), PatchGeometry(8, 1, 1))
    return torch.from_numpy(np.ascontiguousarray(flat)), torch.tensor([grid])


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    hf = randomize_(SiglipVisionModel(SiglipVisionConfig(**VISION)), NORMS)
    root = tmp_path_factory.mktemp("siglip")
    hf.save_pretrained(root)
    return hf, root


@pytest.fixture(scope="module")
def loaded(siglip_dir, megatron_world):
    from loongforge.vlm.hf_siglip import load_tower

    hf, root = siglip_dir
    cfg = encoder_config(init_from_hf=str(root))
    ours = build(cfg, megatron_world)
    load_tower(ours, cfg, root)
    return hf, ours, cfg


@pytest.mark.parametrize("height,width", [(32, 32), (48, 40)], ids=["native_grid", "resampled_positions"])
def test_features_match_transformers(loaded, height, width):
    hf, ours, _ = loaded
    image = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(height + width))
    pixels, grid = patches(image)
    with torch.no_grad():
        expected = hf(pixel_values=image, interpolate_pos_encoding=True).last_hidden_state[0]
        got = ours(pixels, grid)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_save_tower_loads_in_transformers_bitwise(loaded, tmp_path):
    """HF -> ours -> HF: every tower tensor bitwise the original; the head is not written."""
    from loongforge.vlm.hf_siglip import save_tower

    hf, ours, cfg = loaded
    save_tower(ours, cfg, tmp_path / "tower")
    back = SiglipVisionModel.from_pretrained(tmp_path / "tower")
    original, written = hf.state_dict(), back.state_dict()
    assert set(written) == {k for k in original if not k.startswith("head.")}
    assert all(torch.equal(written[k], original[k]) for k in written)


def test_whole_siglip_and_llava_onevision_towers(megatron_world, tmp_path, capsys):
    """A ``SiglipModel`` directory (text tower beside) and a LLaVA-OneVision one (projector, LM,
    ``image_newline`` beside; features before ``post_layernorm``) give their tower; converting
    either as a whole VLM is one error saying to use ``encoder.init_from_hf``."""
    from loongforge.vlm.cli import main
    from loongforge.vlm.hf_siglip import load_tower, read_tower

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    siglip = randomize_(SiglipModel(SiglipConfig(vision_config=VISION, text_config=text)), NORMS)
    siglip.save_pretrained(tmp_path / "siglip")
    llava = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
        vision_config={**VISION, "model_type": "siglip_vision_model"},
        text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1), image_token_index=60, video_token_index=61))
    randomize_(llava, NORMS)
    llava.save_pretrained(tmp_path / "llava")
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pixels, grid = patches(image)
    with torch.no_grad():
        towers = {"siglip": siglip.vision_model(pixel_values=image).last_hidden_state[0],
                  "llava": llava.model.vision_tower(pixel_values=image, output_hidden_states=True).hidden_states[-1][0]}
    for name, expected in towers.items():
        tower = read_tower(tmp_path / name)
        cfg = encoder_config(post_norm=name == "siglip")
        assert tower.encoder == {k: getattr(cfg, k) for k in tower.encoder}
        ours = build(cfg, megatron_world)
        load_tower(ours, cfg, tmp_path / name)
        with torch.no_grad():
            torch.testing.assert_close(ours(pixels, grid), expected, atol=1e-5, rtol=0)
        assert main(["convert", "hf-to-lf", str(tmp_path / name), str(tmp_path / f"{name}-lf"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"encoder.init_from_hf={tmp_path / name}" in err
        assert ("image_newline" in err) == (name == "llava")


def test_unmapped_tensor_and_mismatched_config_are_refused(siglip_dir, megatron_world, tmp_path):
    from safetensors.torch import load_file, save_file

    from loongforge.vlm.hf_siglip import load_tower

    _, root = siglip_dir
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_text((root / "config.json").read_text())
    save_file({**load_file(root / "model.safetensors"), "encoder.layers.0.extra.weight": torch.zeros(2)},
              stray / "model.safetensors", metadata={"format": "pt"})
    cfg = encoder_config()
    ours = build(cfg, megatron_world)
    with pytest.raises(ConfigError, match=r"encoder\.layers\.0\.extra\.weight"):
        load_tower(ours, cfg, stray)
    with pytest.raises(ConfigError, match=r"encoder\.ffn_hidden_size=128 .*set encoder\.ffn_hidden_size=64"):
        load_tower(build(encoder_config(ffn_hidden_size=128), megatron_world), encoder_config(ffn_hidden_size=128), root)
    act = tmp_path / "act"
    act.mkdir()
    (act / "model.safetensors").symlink_to(root / "model.safetensors")
    (act / "config.json").write_text(json.dumps({**json.loads((root / "config.json").read_text()), "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        load_tower(ours, cfg, act)


FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "train.steps=2", "log.progress=false",
        "log.tensorboard=false", "checkpoint.save=false"]
SIGLIP_PARTS = ["encoder=siglip_vit_debug", "projector=mlp_2x"]


def test_training_starts_from_the_tower(megatron_world, tmp_path, vlm_cache):
    """``encoder.init_from_hf=DIR``: the trainer's encoder gives transformers' features, then the
    projector trains on them."""
    from loongforge.core.training.loop import Trainer
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.recipe import VLMTask

    hf = randomize_(SiglipVisionModel(SiglipVisionConfig(**{**VISION, "image_size": 64})), NORMS)  # siglip_vit_debug's
    hf.save_pretrained(tmp_path / "siglip")
    cfg = load_vlm_config("vlm_debug", [*SIGLIP_PARTS, f"encoder.init_from_hf={tmp_path / 'siglip'}",
                                        "trainable=[projector]", *FAST, f"data.cache_dir={vlm_cache}",
                                        f"log.run_dir={tmp_path / 'run'}"])
    trainer = Trainer(VLMTask(cfg), megatron_world, cfg)
    image = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    pixels, grid = patches(image)
    with torch.no_grad():
        expected = hf(pixel_values=image).last_hidden_state[0]
        torch.testing.assert_close(trainer.model.module.encoder(pixels, grid), expected, atol=1e-5, rtol=0)
    assert len(trainer.fit()) == 2


def test_init_from_hf_config_errors(capsys, siglip_dir):
    from loongforge.vlm.cli import main

    _, root = siglip_dir
    assert main(["info", *SIGLIP_PARTS, f"encoder.init_from_hf={root}", "checkpoint.load=/nowhere"]) == 2
    assert f"encoder.init_from_hf={root} and checkpoint.load=/nowhere both give" in capsys.readouterr().err
    assert main(["info", f"encoder.init_from_hf={root}"]) == 2  # qwen2_5_vit reads no SigLIP tower
    assert "init_from_hf" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.long  # (the default tier's budget: test_vlm_parallel.py runs the tower at TP=2 against one process)
def test_tensor_parallel_encoder_reads_its_shards(siglip_dir, tmp_path):
    """Two processes, encoder TP=2: each rank reads its shards of the tower; the features are
    transformers'."""
    from pathlib import Path

    from cli_runner import run_script

    hf, root = siglip_dir
    image = torch.randn(1, 3, 40, 48, generator=torch.Generator().manual_seed(7))
    torch.save(image, tmp_path / "image.pt")
    proc = run_script(Path(__file__).with_name("siglip_tp_probe.py"),
                      [str(root), str(tmp_path / "image.pt"), str(tmp_path / "out.pt")], nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["tp"] == 2
    with torch.no_grad():
        expected = hf(pixel_values=image, interpolate_pos_encoding=True).last_hidden_state[0]
    torch.testing.assert_close(got["features"], expected, atol=1e-5, rtol=0)
