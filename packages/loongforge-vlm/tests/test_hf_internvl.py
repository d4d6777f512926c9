"""InternVL3.5 import/export against transformers' ``InternVLForConditionalGeneration``.

A tiny random transformers model (InternViT: 2 layers, 32 wide, 8x8 patches, 32x32 tiles so a
learned 4x4 position grid, layer scale, attention biases; pixel shuffle 0.5 + LayerNorm MLP
projector; a qwen3 LM: 2 layers, 64 wide, head dim 16, GQA 4/2, q/k norms, untied) is saved with
``save_pretrained`` and converted by the core converter through the ``vlm`` family's InternVL
tables. The converted megatron model gives transformers' logits (fp32, atol 1e-5) for two
images of several tiles, and for tiles larger than the position grid (positions resampled);
a variant with RMSNorm layers and the query/key norm over all heads matches too. Exporting gives
a directory transformers loads with bitwise the same weights.
"""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import InternVLConfig, InternVLForConditionalGeneration

from loongforge.core.hf_mapping import MappingError
from vlm_hf_cases import (assert_reexport_bitwise, assert_stray_tensor_refused, converted_model, exported_files,
                           randomize_)

IMAGE = 300
TEXT = dict(model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8, attention_bias=True)
VARIANTS = {"layernorm": {}, "rmsnorm_qk_norm": {"norm_type": "rms_norm", "use_qk_norm": True}}


def tiny_hf(variant):
    config = InternVLConfig(text_config=TEXT, vision_config={**VISION, **VARIANTS[variant]}, image_token_id=IMAGE,
                            tie_word_embeddings=False)
    return randomize_(InternVLForConditionalGeneration(config))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory, megatron_world):
    root = tmp_path_factory.mktemp(f"internvl_{request.param}")
    hf = tiny_hf(request.param)
    ours, done = converted_model(hf, root, megatron_world)
    return hf, ours, done, root


def sample(tiles_per_image, side):
    """Tokens with each image's ``<IMG_CONTEXT>`` run between text, transformers' pixels
    ``[tiles, 3, side, side]`` and ours (block-major patches, one item per image)."""
    from loongforge.vlm.data.media import PatchGeometry, patchify

    g = torch.Generator().manual_seed(1)
    per_tile = (side // 8 // 2) ** 2
    ids, pixels, ours, grids = [], [], [], []
    for tiles in tiles_per_image:
        ids += torch.randint(0, 290, (3,), generator=g).tolist() + [IMAGE] * (tiles * per_tile)
        x = torch.randn(tiles, 3, side, side, generator=g)
        pixels.append(x)
        patches, grid = patchify(x.numpy(), PatchGeometry(8, 1, 2))
        ours.append(torch.from_numpy(np.ascontiguousarray(patches)))
        grids.append(grid)
    ids += torch.randint(0, 290, (4,), generator=g).tolist()
    return torch.tensor([ids]), torch.cat(pixels), torch.cat(ours), torch.tensor(grids)


@pytest.mark.parametrize("tiles,side", [((3, 1), 32), ((2,), 48)], ids=["tiles", "resampled_positions"])
def test_logits_match_transformers(converted, tiles, side):
    hf, ours, _, _ = converted
    tokens, hf_pixels, pixels, grid_thw = sample(tiles, side)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        expected = hf(input_ids=tokens, pixel_values=hf_pixels).logits
        got = ours(tokens, positions, None, pixel_values=pixels, grid_thw=grid_thw)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_export_loads_in_transformers_bitwise(converted):
    """Export, then transformers' load: bitwise the original weights, on disk too; importing the
    export and exporting again writes the same bytes."""
    hf, _, done, root = converted
    on_disk, written = exported_files(hf, done.path, root)
    assert all(torch.equal(on_disk[k], written[k]) for k in on_disk)
    assert_reexport_bitwise(root, written)


def test_unmapped_tensors_and_compositions_are_refused(converted, tmp_path):
    from loongforge.vlm.hf import config_to_hf

    _, _, done, root = converted
    assert_stray_tensor_refused(root, tmp_path, "vision_tower.extra.weight")
    mrope = dataclasses.replace(done.model_config, vision=dataclasses.replace(done.model_config.vision, rope="mrope"))
    with pytest.raises(MappingError, match="vision.rope='mrope'"):
        config_to_hf(mrope)
