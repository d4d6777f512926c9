"""The frozen encoders of preprocessing: diffusers' ``AutoencoderKLWan`` (or Qwen-Image's
``AutoencoderKLQwenImage``, the same causal 3D layout) for videos and images, a
T5/UMT5 encoder (transformers) for prompts and, for Wan 2.1 I2V, a CLIP vision encoder for the
first frame, loaded from local directories (never downloaded).

Latents are stored normalised as WanPipeline expects them (``(mean - latents_mean) / latents_std``
of the VAE posterior); prompts as the encoder's last hidden state trimmed to the prompt's length
(WanPipeline zero-pads them to ``max_sequence_length`` at use).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge.core.errors import DataError


def _component_dir(path: str | Path, component: str, marker: str = "config.json") -> Path:
    """``path`` itself, or its ``component/`` subfolder (a diffusers pipeline directory)."""
    root = Path(path).expanduser()
    if (root / marker).is_file():
        return root
    if (root / component / marker).is_file():
        return root / component
    raise DataError(f"{path}: no {marker} here or in {component}/ (a local {component} directory is expected)")


def read_component_config(path: str | Path, component: str) -> dict:
    """The config.json of a local ``vae`` / ``text_encoder`` directory."""
    import json

    return json.loads((_component_dir(path, component) / "config.json").read_text())


# the Wan-style causal 3D VAEs preprocessing reads (config.json ``_class_name``): Wan's, and
# Qwen-Image's (images are one-frame videos to it)
VAE_CLASSES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")


def load_vae(path: str | Path, device, dtype=torch.float32):
    import diffusers

    name = read_component_config(path, "vae").get("_class_name", VAE_CLASSES[0])
    if name not in VAE_CLASSES:
        raise DataError(f"{path}: a {name} VAE; preprocessing reads {' or '.join(VAE_CLASSES)}")
    vae = getattr(diffusers, name).from_pretrained(
        str(_component_dir(path, "vae")), local_files_only=True, torch_dtype=dtype, low_cpu_mem_usage=False
    )
    return vae.to(device).eval().requires_grad_(False)


def vae_factors(config: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of a VAE config."""
    return int(config.get("scale_factor_temporal") or 4), int(config.get("scale_factor_spatial") or 8)


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
    return mean, std


@torch.no_grad()
def encode_video(vae, video: torch.Tensor) -> torch.Tensor:
    """``[3, F, H, W]`` in [-1, 1] -> normalised latent ``[z, f, h, w]`` (posterior mean)."""
    param = next(vae.parameters())
    mu = vae.encode(video[None].to(param.device, param.dtype)).latent_dist.mean
    mean, std = _latent_stats(vae, mu)
    return ((mu - mean) / std)[0].float().cpu()


@torch.no_grad()
def decode_latent(vae, latent: torch.Tensor) -> torch.Tensor:
    """Normalised latent ``[z, f, h, w]`` -> video ``[3, F, H, W]`` in [-1, 1]."""
    param = next(vae.parameters())
    z = latent[None].to(param.device, param.dtype)
    mean, std = _latent_stats(vae, z)
    return vae.decode(z * std + mean).sample[0].float().clamp(-1, 1).cpu()


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, device, dtype=torch.float32):
    """``(tokenizer, encoder)``: a T5/UMT5 encoder and its tokenizer from local directories."""
    from transformers import AutoTokenizer, T5EncoderModel, UMT5EncoderModel

    enc_dir = _component_dir(path, "text_encoder")
    tok_dir = _component_dir(tokenizer_path or path, "tokenizer", marker="tokenizer_config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    model_type = read_component_config(path, "text_encoder").get("model_type")
    cls = {"umt5": UMT5EncoderModel, "t5": T5EncoderModel}.get(model_type or "")
    if cls is None:
        raise DataError(f"{enc_dir / 'config.json'}: model_type={model_type!r}; expected 'umt5' or 't5'")
    encoder = cls.from_pretrained(str(enc_dir), local_files_only=True, torch_dtype=dtype)
    return tokenizer, encoder.to(device).eval().requires_grad_(False)


@torch.no_grad()
def encode_prompts(tokenizer, encoder, prompts: list[str], max_sequence_length: int) -> list[torch.Tensor]:
    """Prompt embeddings ``[L_i, D]`` (L_i = prompt tokens incl. EOS), as WanPipeline computes them."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    inputs = tokenizer(
        [prompt_clean(p) for p in prompts],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    device = next(encoder.parameters()).device
    mask = inputs.attention_mask.to(device)
    hidden = encoder(inputs.input_ids.to(device), mask).last_hidden_state
    lengths = mask.gt(0).sum(dim=1).tolist()
    return [h[:n].float().cpu() for h, n in zip(hidden, lengths)]


def load_image_encoder(path: str | Path, device, dtype=torch.float32):
    """``(processor, encoder)``: a CLIP vision encoder (``image_encoder/``) and its image processor
    (``image_processor/``), as in a Wan 2.1 I2V pipeline directory."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    enc_dir = _component_dir(path, "image_encoder")
    proc_dir = _component_dir(path, "image_processor", marker="preprocessor_config.json")
    processor = CLIPImageProcessor.from_pretrained(str(proc_dir), local_files_only=True)
    encoder = CLIPVisionModel.from_pretrained(str(enc_dir), local_files_only=True, torch_dtype=dtype)
    return processor, encoder.to(device).eval().requires_grad_(False)


def image_encoder_width(path: str | Path) -> int:
    """The width of a CLIP vision encoder's tokens (``model.image_dim``)."""
    config = read_component_config(path, "image_encoder")
    return int(config.get("vision_config", config)["hidden_size"])


@torch.no_grad()
def encode_images(processor, encoder, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """CLIP tokens ``[L, D]`` of frames ``[3, H, W]`` in [-1, 1]: the encoder's penultimate hidden
    states, as WanImageToVideoPipeline computes them."""
    pixels = [((f.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy() for f in frames]
    param = next(encoder.parameters())
    inputs = processor(images=pixels, return_tensors="pt").to(param.device)
    hidden = encoder(pixel_values=inputs.pixel_values.to(param.dtype), output_hidden_states=True).hidden_states[-2]
    return [h.float().cpu() for h in hidden]
