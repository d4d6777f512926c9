"""The ``qwen_image`` family against diffusers' ``QwenImageTransformer2DModel`` (tiny random
configs, fp32, CPU): same weights in, same velocities out; its weights to and from diffusers'
layout; its images through preprocessing with ``AutoencoderKLQwenImage``; training from the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from loongforge.diffusion.packing import pack, pad_text, unpack_outputs
from loongforge.diffusion.qwen_image.config import QwenImageConfig
from loongforge.diffusion.qwen_image.transformer import QwenImageTransformer

CFG = QwenImageConfig(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                      axes_dims_rope=[4, 6, 6], out_channels=4, in_channels=16, text_len=7)


def models(cfg: QwenImageConfig = CFG, seed: int = 0):
    torch.manual_seed(seed)
    theirs = QwenImageTransformer2DModel(**cfg.diffusers_kwargs()).eval()
    with torch.no_grad():  # diffusers zero-initialises nothing here, but give every tensor a random value
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    ours = QwenImageTransformer(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def pipeline_pack(latent: torch.Tensor) -> torch.Tensor:
    """``[C, 1, H, W]`` -> ``[h*w, C*4]``, QwenImagePipeline's 2x2 packing (channels, then the patch)."""
    c, _, h, w = latent.shape
    return latent[:, 0].reshape(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4).reshape(h * w // 4, c * 4)


def pipeline_unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pipeline_pack`` for the transformer's output ``[h*w/4, C*4]`` -> ``[C, 1, H, W]``."""
    c = tokens.shape[1] // 4
    return tokens.reshape(h // 2, w // 2, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, 1, h, w)


def reference(theirs, latents, timesteps, texts):
    """diffusers' velocity of each sample, a batch of one per sample, prompts masked as the
    pipeline masks them (padded to ``text_len``)."""
    out = []
    for x, t, text in zip(latents, timesteps, texts):
        h, w = x.shape[-2:]
        padded = pad_text([text], CFG.text_len)
        mask = torch.zeros(1, CFG.text_len, dtype=torch.long)
        mask[0, : text.shape[0]] = 1
        v = theirs(hidden_states=pipeline_pack(x)[None], encoder_hidden_states=padded, encoder_hidden_states_mask=mask,
                   timestep=(t / 1000.0).reshape(1), img_shapes=[[(1, h // 2, w // 2)]], return_dict=False)[0]
        out.append(pipeline_unpack(v[0], h, w))
    return out


def ours_velocity(ours, latents, timesteps, texts):
    batch = pack(latents, timesteps, pad_text(texts, CFG.text_len), CFG.patch, text_lengths=[t.shape[0] for t in texts])
    return unpack_outputs(ours(batch), batch, CFG.patch)


@torch.no_grad()
def test_forward_equals_diffusers_on_a_pack_of_mixed_sizes_and_prompt_lengths():
    ours, theirs = models()
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(4, 1, 8, 12, generator=g), torch.randn(4, 1, 10, 6, generator=g),
               torch.randn(4, 1, 4, 4, generator=g)]
    texts = [torch.randn(n, 24, generator=g) for n in (7, 3, 5)]
    timesteps = torch.tensor([900.0, 250.0, 17.0])
    want = reference(theirs, latents, timesteps, texts)
    got = ours_velocity(ours, latents, timesteps, texts)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_a_batch_of_one_size_equals_one_diffusers_batch_with_its_mask():
    ours, theirs = models(seed=3)
    g = torch.Generator().manual_seed(4)
    latents = [torch.randn(4, 1, 8, 8, generator=g) for _ in range(2)]
    texts = [torch.randn(n, 24, generator=g) for n in (2, 7)]
    timesteps = torch.tensor([500.0, 500.0])
    mask = torch.tensor([[1] * 2 + [0] * 5, [1] * 7])
    v = theirs(hidden_states=torch.stack([pipeline_pack(x) for x in latents]), encoder_hidden_states=pad_text(texts, 7),
               encoder_hidden_states_mask=mask, timestep=timesteps / 1000.0, img_shapes=[[(1, 4, 4)]] * 2,
               return_dict=False)[0]
    got = ours_velocity(ours, latents, timesteps, texts)
    for i in range(2):
        torch.testing.assert_close(got[i], pipeline_unpack(v[i], 8, 8), atol=2e-5, rtol=1e-4)


def test_gradients_flow_and_recompute_gives_the_same_ones():
    ours, _ = models(seed=5)
    ours.train()
    g = torch.Generator().manual_seed(6)
    latents = [torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 4, 8, generator=g)]
    texts = [torch.randn(n, 24, generator=g) for n in (4, 6)]
    batch = pack(latents, torch.tensor([300.0, 700.0]), pad_text(texts, 7), CFG.patch, text_lengths=[4, 6])
    grads = []
    for mode in ("none", "full"):
        ours.zero_grad()
        ours.set_recompute(mode)
        ours(batch).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad})
    assert all(g.abs().sum() > 0 for g in grads[0].values())
    # the last block's prompt-stream tail feeds nothing (as in diffusers): frozen, the rest trains
    frozen = sorted(n for n, p in ours.named_parameters() if not p.requires_grad)
    assert frozen and all(n.startswith(tuple(f"transformer_blocks.1.{m}." for m in (
        "attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp")))
                          for n in frozen)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n])


def test_weights_round_trip_through_diffusers_directories(tmp_path):
    from loongforge.diffusion.qwen_image.convert import export_diffusers, load_pretrained, pretrained_architecture

    ours, theirs = models(seed=7)
    theirs.save_pretrained(str(tmp_path / "pipe" / "transformer"))
    arch, source = pretrained_architecture(tmp_path / "pipe")
    assert source == tmp_path / "pipe" / "transformer" / "config.json"
    assert QwenImageConfig(**arch, text_len=CFG.text_len) == CFG

    loaded = QwenImageTransformer(CFG)
    load_pretrained(loaded, tmp_path / "pipe")
    for k, v in theirs.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    [out] = export_diffusers(ours.state_dict(), CFG, tmp_path / "export")
    back = QwenImageTransformer2DModel.from_pretrained(str(out))
    assert back.state_dict().keys() == theirs.state_dict().keys()
    for k, v in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k

    with pytest.raises(ValueError, match="num_layers=2 but model.num_layers=3"):
        load_pretrained(QwenImageTransformer(QwenImageConfig(**{**arch, "num_layers": 3})), out)


def test_unsupported_variants_are_refused_by_name():
    with pytest.raises(ValueError, match="zero_cond_t=True is not supported"):
        QwenImageConfig.from_diffusers({**CFG.diffusers_kwargs(), "zero_cond_t": True})
    with pytest.raises(ValueError, match=r"model.in_channels=12 must be model.out_channels x model.patch_size\^2"):
        QwenImageConfig(in_channels=12)


@torch.no_grad()
def test_images_preprocess_to_one_frame_latents_of_the_qwen_image_vae(tmp_path, builtin_latents):
    """``lf-diffusion preprocess`` with ``AutoencoderKLQwenImage``: an image is a one-frame latent,
    normalised by the VAE's ``latents_mean``/``latents_std`` as QwenImagePipeline does."""
    from diffusers import AutoencoderKLQwenImage
    from PIL import Image

    from loongforge.diffusion.data.shards import LatentShards
    from loongforge.diffusion.data.video_io import read_frames, to_model_input
    from loongforge.diffusion.preprocess import PreprocessConfig, preprocess

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 0.5, 2.0, 1.0]).eval()
    vae.save_pretrained(str(tmp_path / "vae"))
    images = tmp_path / "images"
    images.mkdir()
    rng = torch.Generator().manual_seed(1)
    rows = []
    for i, (h, w) in enumerate(((32, 32), (32, 48))):
        pixels = (torch.rand(h, w, 3, generator=rng) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(images / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": "a red circle"})
    (images / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoders = builtin_latents.parent / "encoders"
    out = tmp_path / "latents"
    preprocess(PreprocessConfig(input=str(images), output=str(out), vae=str(tmp_path / "vae"), text_encoder=str(encoders),
                                max_sequence_length=16, max_frames=1, max_area=48 * 48, patch_size=2, progress=False),
               rank=0, world=1)
    data = LatentShards(out)
    for i in range(2):
        latent, _ = data.load(i)
        video = to_model_input(read_frames(images / f"{i}.png", 1), 48 * 48, 16, 4)
        mu = vae.encode(video[None]).latent_dist.mean[0]
        mean, std = (torch.tensor(v).view(4, 1, 1, 1) for v in (vae.config.latents_mean, vae.config.latents_std))
        assert latent.shape[1] == 1
        torch.testing.assert_close(latent, (mu - mean) / std, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cli_trains_qwen_image_debug_then_exports_and_samples(tmp_path, synthetic_overrides):
    """``lf-diffusion train --config qwen_image_debug`` on the built-in set encoded as images, then
    ``convert lf-to-diffusers`` (a QwenImageTransformer2DModel diffusers loads), ``model.pretrained``
    of the export, and ``sample``."""
    from loongforge.core.checkpoint import load_checkpoint
    from loongforge.core.config import ConfigError
    from loongforge.core.metrics import read_metrics
    from loongforge.diffusion.cli import load_recipe, main
    from loongforge.diffusion.model.convert import read_diffusers_weights

    run = tmp_path / "run"
    assert main(["train", "--config", "qwen_image_debug", f"log.run_dir={run}", "train.steps=4", "checkpoint.interval=4",
                 "train.global_batch_size=4", "ema.decay=0.5", *synthetic_overrides]) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["grad_norm"] > 0 for r in records)
    tensors, manifest, _ = load_checkpoint(run / "checkpoints")
    assert manifest["family"] == "qwen_image" and manifest["config"]["model"]["family"] == "qwen_image"
    assert manifest["config"]["data"]["synthetic_frames"] == 1

    out = tmp_path / "hf"
    assert main(["convert", "lf-to-diffusers", str(run), str(out), "--ema"]) == 0
    exported = read_diffusers_weights(out)
    for key, value in exported.items():  # EMA of the trained weights, model weights of the frozen tail
        assert torch.equal(value, tensors.get(f"ema.{key}", tensors[f"model.{key}"])), key
    loaded = QwenImageTransformer2DModel.from_pretrained(str(out))
    assert set(loaded.state_dict()) == set(exported)

    recipe = load_recipe("qwen_image_debug", [f"model.pretrained={out}"])
    assert recipe.model.family == "qwen_image" and recipe.model.num_layers == 2
    with pytest.raises(ConfigError, match="model.num_layers=3 but"):
        load_recipe("qwen_image_debug", [f"model.pretrained={out}", "model.num_layers=3"])

    assert main(["sample", "--run", str(run), "sample.num_steps=2", "sample.num_samples=2"]) == 0
    assert (run / "samples" / "step_00000004.png").is_file()
