"""Qwen2.5-VL import/export against transformers' ``Qwen2_5_VLForConditionalGeneration``.

A tiny random transformers model (ViT: 3 layers, 32 wide, windows of 2x2 LLM tokens with layer
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
from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

IDS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, window_size=32, out_hidden_size=64, fullatt_block_indexes=[1], tokens_per_second=2)
PATCH_DIM = 3 * 2 * 8 * 8


def tiny_hf(seed=0):
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, **IDS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight random, norms around 1
            p.copy_((1.0 if "norm" in name or "ln_q" in name else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def load_lf_weights(module, checkpoint) -> None:
    """The model weights of a LoongForge checkpoint into a bare megatron module."""
    from loongforge.core.checkpoint import Checkpoint
    from loongforge.core.checkpoint.sharded import load_into

    ckpt = Checkpoint(checkpoint)
    objects = ckpt.objects(0)
    common = objects.get("common", {})
    state = load_into({"model": module.sharded_state_dict()}, ckpt.reader, objects.get("sharded_objects", {}),
                      {"model": common["model"]} if "model" in common else {})
    module.load_state_dict(state["model"], strict=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, megatron_world):
    from megatron.core.transformer import TransformerConfig

    from loongforge.vlm.family import build_vlm

    root = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = tiny_hf()
    hf.save_pretrained(root / "hf")
    done = hf_to_lf(root / "hf", root / "lf", progress=False)
    cfg = done.model_config
    tc = TransformerConfig(**cfg.foundation.transformer_config_kwargs(), mrope_section=cfg.mrope_section,
                           use_cpu_initialization=True, calculate_per_token_loss=True)
    ours = build_vlm(cfg, megatron_world, tc).eval()
    load_lf_weights(ours, done.path)
    return hf, ours, done, root


def sample(parts):
    """Token ids, the vision items in order and their patches: ``parts`` are text lengths,
    ("image", (t, h, w)) or ("video", (t, h, w), seconds_per_grid_t)."""
    from loongforge.vlm.positions import VisionItem

    g = torch.Generator().manual_seed(1)
    ids, items, pixels = [], [], {"image": [], "video": []}
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, 290, (part,), generator=g).tolist()
            continue
        kind, (t, h, w), *rest = part
        ids += [IDS["vision_start_token_id"]] + [IDS[f"{kind}_token_id"]] * (t * h * w // 4) + [IDS["vision_end_token_id"]]
        items.append((kind, VisionItem((t, h, w), kind == "video", rest[0] if rest else 1.0)))
        pixels[kind].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
    return torch.tensor([ids]), items, pixels


CASES = {
    "images": [5, ("image", (1, 8, 8)), 4, ("image", (1, 6, 10)), 6],
    "video": [3, ("video", (2, 6, 8), 0.5), 7],
    "mixed": [2, ("video", (3, 4, 6), 1.0), 3, ("image", (1, 10, 6)), 5],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(converted, case):
    from loongforge.vlm.positions import mrope_positions

    hf, ours, _, _ = converted
    tokens, items, pixels = sample(CASES[case])
    kw = {"mm_token_type_ids": (tokens == IDS["image_token_id"]).int() + 2 * (tokens == IDS["video_token_id"]).int()}
    for kind in ("image", "video"):
        grids = [item.grid for k, item in items if k == kind]
        if grids:
            key = "pixel_values" if kind == "image" else "pixel_values_videos"
            kw[key] = torch.cat(pixels[kind])
            kw[f"{kind}_grid_thw"] = torch.tensor(grids)
    if "video_grid_thw" in kw:
        kw["second_per_grid_ts"] = torch.tensor([item.seconds_per_grid_t for k, item in items if k == "video"])
    order = {"image": iter(pixels["image"]), "video": iter(pixels["video"])}
    ours_pixels = torch.cat([next(order[k]) for k, _ in items])  # the items in token order
    grid_thw = torch.tensor([item.grid for _, item in items])
    positions = mrope_positions(tokens[0].numpy(), [item for _, item in items],
                                (IDS["image_token_id"], IDS["video_token_id"]), 2, VISION["tokens_per_second"])
    with torch.no_grad():
        expected = hf(input_ids=tokens, **kw).logits
        got = ours(tokens, torch.from_numpy(positions)[:, None, :], None, pixel_values=ours_pixels, grid_thw=grid_thw)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_export_loads_in_transformers_bitwise(converted):
    from safetensors.torch import load_file

    hf, _, done, root = converted
    lf_to_hf(done.path, root / "exported", progress=False)
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "exported").eval()
    original, exported = hf.state_dict(), back.state_dict()
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    on_disk = {**load_file(root / "hf" / "model.safetensors")}
    written = {**load_file(root / "exported" / "model.safetensors")}
    assert sorted(on_disk) == sorted(written)
    assert all(torch.equal(on_disk[k], written[k]) for k in on_disk)


def test_compositions_without_hf_counterpart_are_refused(converted):
    import dataclasses

    from loongforge.vlm.encoders.siglip_vit import SigLIPViTConfig
    from loongforge.vlm.hf import config_to_hf

    _, _, done, _ = converted
    siglip = dataclasses.replace(done.model_config, encoder=SigLIPViTConfig())
    with pytest.raises(MappingError, match="encoder.family='siglip_vit'"):
        config_to_hf(siglip)
