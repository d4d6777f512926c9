"""Qwen3-VL import/export against transformers' ``Qwen3VLForConditionalGeneration`` and
``Qwen3VLMoeForConditionalGeneration``.

A tiny random transformers model (ViT: 3 layers, 32 wide, a learned 4x4 position grid, DeepStack
from layers 0 and 2; LM: 3 layers, 64 wide, head dim 16, GQA 4/2, q/k norms, interleaved
multimodal RoPE; the MoE one with 4 experts, top-2, in every layer) is saved with
``save_pretrained`` and converted by the core converter through the ``vlm`` family's Qwen3-VL
tables. The converted megatron model gives transformers' logits
(fp32, atol 1e-5) for images (grids larger, smaller and equal to the position grid), a video whose frames
are separated by timestamp text, and both together; exporting gives a directory transformers
loads with bitwise the same weights.
"""

import dataclasses

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from loongforge.core.hf_mapping import MappingError
from vlm_hf_cases import (assert_reexport_bitwise, assert_stray_tensor_refused, converted_model, exported_files,
                           logits_pair, make_sample, randomize_, QWEN3_VL_CASES)

IDS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)  # 2 x 16 != 64: the layouts differ
PATCH_DIM = 3 * 2 * 8 * 8
MODELS = {"dense": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}),
          "moe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, MOE)}
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def tiny_hf(kind):
    config, model, extra = MODELS[kind]
    return randomize_(model(config(text_config={**TEXT, **extra}, vision_config=VISION, **IDS)))


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory, megatron_world):
    root = tmp_path_factory.mktemp(f"qwen3_vl_{request.param}")
    hf = tiny_hf(request.param)
    ours, done = converted_model(hf, root, megatron_world)
    return hf, ours, done, root


CASES = QWEN3_VL_CASES


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(converted, case):
    from loongforge.vlm.positions import mrope_positions

    hf, ours, _, _ = converted
    sample = make_sample(CASES[case], IDS, PATCH_DIM, frame_text=3)
    positions = mrope_positions(sample.tokens[0].numpy(), [item for _, item in sample.items],
                                (IDS["image_token_id"], IDS["video_token_id"]), 2, 2.0, frames_as_images=True)
    expected, got = logits_pair(hf, ours, sample, IDS, positions)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_deepstack_changes_the_logits(converted):
    """The DeepStack additions are live: zeroing one merger's output layer changes the logits."""
    _, ours, _, _ = converted
    sample = make_sample(CASES["images"], IDS, PATCH_DIM)
    pixels, grid_thw = sample.ours()
    positions = torch.arange(sample.tokens.shape[1])[None, None].expand(3, 1, -1)
    fc2 = ours.deepstack[1].mlp.encoder.linear_fc2
    with torch.no_grad():
        before = ours(sample.tokens, positions, None, pixel_values=pixels, grid_thw=grid_thw)
        saved = fc2.weight.clone(), fc2.bias.clone()
        fc2.weight.zero_(), fc2.bias.zero_()
        after = ours(sample.tokens, positions, None, pixel_values=pixels, grid_thw=grid_thw)
        fc2.weight.copy_(saved[0]), fc2.bias.copy_(saved[1])
    assert not torch.allclose(before, after, atol=1e-6)


def test_export_loads_in_transformers_bitwise(converted):
    """Export, then transformers' load: bitwise the original weights. On disk too, except that
    MoE experts are written in the released checkpoints' layout (transformers saves its in-memory
    one, each fused tensor transposed)."""
    hf, _, done, root = converted
    on_disk, written = exported_files(hf, done.path, root)
    for k in on_disk:
        expected = on_disk[k].transpose(1, 2) if k.endswith(FUSED_EXPERTS) else on_disk[k]
        assert torch.equal(expected, written[k]), k
    assert any(k.endswith(FUSED_EXPERTS) for k in on_disk) == (done.model_config.foundation.family == "qwen3_moe")
    assert_reexport_bitwise(root, written)  # the exported directory (released expert layout), bit for bit


def test_unmapped_tensors_and_compositions_are_refused(converted, tmp_path):
    from loongforge.vlm.hf import config_to_hf

    _, _, done, root = converted
    assert_stray_tensor_refused(root, tmp_path, "model.visual.extra.weight")
    rmsnorm = dataclasses.replace(done.model_config, projector=dataclasses.replace(done.model_config.projector,
                                                                                   norm="rmsnorm"))
    with pytest.raises(MappingError, match="projector.norm='rmsnorm'"):
        config_to_hf(rmsnorm)


@pytest.mark.parametrize("section", [[24, 20, 20], [16, 24, 24], [2, 3, 3], [8, 0, 0]])
def test_interleaved_rotary_chunks_match_transformers(section, megatron_world):
    """megatron's multimodal RoPE with ``rotary_chunks`` gives transformers' Qwen3-VL angles."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from loongforge.vlm.model_config import VisionTokensConfig

    head_dim = 2 * sum(section)
    text = Qwen3VLConfig(text_config={**TEXT, "head_dim": head_dim, "rope_parameters": {
        **TEXT["rope_parameters"], "mrope_section": section}}).text_config
    positions = torch.randint(0, 50, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    cos, _ = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)
    chunks = VisionTokensConfig(rope="mrope_interleaved", mrope_section=section).rotary_chunks(head_dim)
    angles = MultimodalRotaryEmbedding(head_dim, 1.0, rotary_base=10000)(positions, chunks)  # [s, b, 1, head_dim]
    torch.testing.assert_close(angles[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_vl_8b", "qwen3_vl_30b_a3b"])
def test_released_configs_count_what_transformers_builds(name):
    """``lf-vlm info``'s parameter count of a shipped released config equals transformers' model
    of its exported ``config.json`` (built on the meta device)."""
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.hf import config_to_hf

    cfg = load_vlm_config(name, ["vision.image_token_id=151655", "vision.video_token_id=151656"]).model()
    config, model = MODELS["moe" if cfg.foundation.family == "qwen3_moe" else "dense"][:2]
    with torch.device("meta"):
        hf = model(config.from_dict(config_to_hf(cfg)))
    assert sum(cfg.parameter_counts().values()) == sum(p.numel() for p in hf.parameters())
