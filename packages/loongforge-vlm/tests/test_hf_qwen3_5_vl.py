"""Qwen3.5 import/export against transformers' ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForConditionalGeneration``.

A tiny random transformers model (ViT: 2 layers, 32 wide, a learned 4x4 position grid, no
DeepStack; LM: 3 layers, 64 wide: Gated DeltaNet, gated full attention, Gated DeltaNet; head dim 64
of which a quarter rotates, GQA 4/2, interleaved multimodal RoPE over 8 frequency pairs; the MoE one
with 4 experts, top-2 and a gated shared expert in every layer) is saved with ``save_pretrained``
and converted by the core converter through the ``vlm`` family's Qwen3.5 tables. The converted
megatron model gives transformers' logits (fp32, atol 5e-5) for images (grids larger, smaller and
equal to the position grid), a video whose frames are separated by timestamp text, and both
together, and transformers' loss with labels; exporting gives a directory transformers loads with
bitwise the same weights.
"""

import pytest
import torch
from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration)

from loongforge.core.hf_mapping import MappingError
from vlm_hf_cases import (assert_reexport_bitwise, assert_stray_tensor_refused, converted_model, exported_files,
                           logits_pair, make_sample, randomize_, QWEN3_VL_CASES)

IDS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=512,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
PATCH_DIM = 3 * 2 * 8 * 8
# fp32 logits up to ~3.5: the Gated DeltaNet's chunked delta rule sums in another order than transformers', and
# the difference grows along the sequence's ~70 tokens to ~1e-5 of the largest logit (2e-5 in loongforge-llm's
# shorter text-only Qwen3.5 test)
ATOL = 5e-5
MODELS = {"dense": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, {}),
          "moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, MOE)}


def tiny_hf(kind):
    config, model, extra = MODELS[kind]
    text = {k: v for k, v in TEXT.items() if not (extra and k == "intermediate_size")}
    return randomize_(model(config(text_config={**text, **extra}, vision_config=VISION, **IDS)))


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory, megatron_world):
    root = tmp_path_factory.mktemp(f"qwen3_5_vl_{request.param}")
    hf = tiny_hf(request.param)
    ours, done = converted_model(hf, root, megatron_world)
    return hf, ours, done, root


CASES = QWEN3_VL_CASES


def positions_of(sample):
    from loongforge.vlm.positions import mrope_positions

    return mrope_positions(sample.tokens[0].numpy(), [item for _, item in sample.items],
                           (IDS["image_token_id"], IDS["video_token_id"]), 2, 2.0, frames_as_images=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(converted, case):
    hf, ours, _, _ = converted
    sample = make_sample(CASES[case], IDS, PATCH_DIM, frame_text=3)
    expected, got = logits_pair(hf, ours, sample, IDS, positions_of(sample))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_loss_matches_transformers(converted):
    """transformers' mean next-token loss (``labels=input_ids``) is ours over the same tokens."""
    hf, ours, done, _ = converted
    sample = make_sample(CASES["mixed"], IDS, PATCH_DIM, frame_text=3)
    tokens = sample.tokens
    pixels, grid_thw = sample.ours()
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # ours: the next token; the last one does not count
    positions = torch.as_tensor(positions_of(sample))[:, None, :]
    with torch.no_grad():
        expected = hf(input_ids=tokens, labels=tokens, **sample.hf_inputs(IDS)).loss
        per_token = ours(tokens, positions, None, labels=labels, pixel_values=pixels, grid_thw=grid_thw)
    got = per_token[:, :-1].float().mean()
    if done.model_config.foundation.family == "qwen3_5_moe":  # transformers adds no router loss without the flag
        assert not hf.config.text_config.output_router_logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_conversion_reads_the_composition(converted):
    """No DeepStack, the rotated quarter of each head split into transformers' interleaved section."""
    _, ours, done, _ = converted
    cfg = done.model_config
    assert cfg.encoder.family == "qwen3_vit" and list(cfg.encoder.deepstack_layers) == [] and ours.deepstack is None
    assert cfg.foundation.rotary_percent == 0.25 and cfg.rotary_dim == 16 and cfg.mrope_section == [3, 3, 2]
    assert cfg.foundation.layer_types == TEXT["layer_types"]


def test_export_loads_in_transformers_bitwise(converted):
    hf, _, done, root = converted
    on_disk, written = exported_files(hf, done.path, root)
    for k in on_disk:
        assert torch.equal(on_disk[k], written[k]), k
    assert_reexport_bitwise(root, written)


def test_unmapped_tensors_and_compositions_are_refused(converted, tmp_path):
    import dataclasses

    from loongforge.vlm.hf import config_to_hf

    _, _, done, root = converted
    assert_stray_tensor_refused(root, tmp_path, "model.visual.extra.weight")
    (tmp_path / "lm").mkdir()
    assert_stray_tensor_refused(root, tmp_path / "lm", "model.language_model.layers.0.linear_attn.extra")
    cfg = done.model_config
    deepstack = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, deepstack_layers=[0]))
    with pytest.raises(MappingError, match=r"encoder.deepstack_layers=\[0\]"):
        config_to_hf(deepstack)


def test_multi_token_prediction_tensors_are_ignored(converted, tmp_path):
    """Released checkpoints carry an MTP head (``mtp.*``), which is not built: import skips it."""
    from safetensors.torch import load_file, save_file

    from loongforge.core.hf_mapping.convert import hf_to_lf

    _, _, _, root = converted
    with_mtp = tmp_path / "mtp"
    with_mtp.mkdir()
    (with_mtp / "config.json").write_bytes((root / "hf" / "config.json").read_bytes())
    save_file({**load_file(root / "hf" / "model.safetensors"), "mtp.fc.weight": torch.zeros(2, 2)},
              with_mtp / "model.safetensors")
    assert hf_to_lf(with_mtp, tmp_path / "lf", progress=False).model_config.foundation.family.startswith("qwen3_5")


def test_packed_row_gives_each_sample_its_own_logits(converted):
    """Two samples packed into one THD row (how ``lf-vlm train`` feeds a foundation with Gated DeltaNet
    layers): each sample's logits are those it gets alone; the DeltaNet state and the attention restart
    at the second sample and its multimodal RoPE angles are its own positions'."""
    import numpy as np

    from loongforge.llm.api import packed_seq_params
    from loongforge.vlm.data.packing import pack_thd

    _, ours, _, _ = converted
    samples, alone = [], []
    for case in ("mixed", "images"):
        sample = make_sample(CASES[case], IDS, PATCH_DIM, frame_text=3)
        pixels, grid_thw = sample.ours()
        tokens = sample.tokens[0].numpy()
        samples.append({"tokens": tokens, "labels": tokens, "loss_mask": np.ones_like(tokens),
                        "position_ids": positions_of(sample), "pixel_values": pixels.numpy(),
                        "grid_thw": grid_thw.numpy()})
        with torch.no_grad():
            alone.append(ours(sample.tokens, torch.as_tensor(positions_of(sample))[:, None, :], None,
                              pixel_values=pixels, grid_thw=grid_thw))
    row = pack_thd(samples)
    with torch.no_grad():
        packed = ours(row["tokens"], row["position_ids"], None, pixel_values=row["pixel_values"],
                      grid_thw=row["grid_thw"], packed_seq_params=packed_seq_params(row))
    # (fp32: a packed row's GEMMs sum in another order than each sample's alone, ~1e-5 at these logits)
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=1e-4)
