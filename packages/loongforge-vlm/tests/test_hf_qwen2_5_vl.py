"""Qwen2.5-VL import/export against transformers' ``Qwen2_5_VLForConditionalGeneration``.

A tiny random transformers model (ViT: 3 layers, 32 wide, an MLP 62 wide as Qwen2.5-VL's 3,420 is not a
multiple of 16 bytes, so its output linear pads its GEMMs; windows of 2x2 LLM tokens with layer
1 full attention; LM: 2 layers, 64 wide, GQA 4/2, multimodal RoPE) is saved with
``save_pretrained`` and converted by the core converter through the ``vlm`` family's mapping
tables. The converted megatron model gives transformers' logits (fp32, atol 1e-5) for image +
text, video + text and mixed inputs, with images whose grids do not tile into whole windows;
exporting gives a directory transformers loads with bitwise the same weights.
"""

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from loongforge.core.hf_mapping import MappingError
from vlm_hf_cases import converted_model, exported_files, logits_pair, make_sample, randomize_

IDS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(depth=3, hidden_size=32, intermediate_size=62, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, window_size=32, out_hidden_size=64, fullatt_block_indexes=[1], tokens_per_second=2)
PATCH_DIM = 3 * 2 * 8 * 8


def tiny_hf():
    return randomize_(Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, **IDS)))


@pytest.fixture(scope="module")
def converted(tmp_path_factory, megatron_world):
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = tiny_hf()
    ours, done = converted_model(hf, root, megatron_world)
    return hf, ours, done, root


CASES = {
    "images": [5, ("image", (1, 8, 8)), 4, ("image", (1, 6, 10)), 6],
    "video": [3, ("video", (2, 6, 8), 0.5), 7],
    "mixed": [2, ("video", (3, 4, 6), 1.0), 3, ("image", (1, 10, 6)), 5],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(converted, case):
    from loongforge.vlm.positions import mrope_positions

    hf, ours, _, _ = converted
    sample = make_sample(CASES[case], IDS, PATCH_DIM)
    kw = {}
    if any(k == "video" for k, _ in sample.items):
        kw["second_per_grid_ts"] = torch.tensor([item.seconds_per_grid_t for k, item in sample.items if k == "video"])
    positions = mrope_positions(sample.tokens[0].numpy(), [item for _, item in sample.items],
                                (IDS["image_token_id"], IDS["video_token_id"]), 2, VISION["tokens_per_second"])
    expected, got = logits_pair(hf, ours, sample, IDS, positions, **kw)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_export_loads_in_transformers_bitwise(converted):
    hf, _, done, root = converted
    on_disk, written = exported_files(hf, done.path, root)
    assert all(torch.equal(on_disk[k], written[k]) for k in on_disk)


def test_compositions_without_hf_counterpart_are_refused(converted):
    import dataclasses

    from loongforge.vlm.encoders.siglip_vit import SigLIPViTConfig
    from loongforge.vlm.hf import config_to_hf

    _, _, done, _ = converted
    siglip = dataclasses.replace(done.model_config, encoder=SigLIPViTConfig())
    with pytest.raises(MappingError, match="encoder.family='siglip_vit'"):
        config_to_hf(siglip)
