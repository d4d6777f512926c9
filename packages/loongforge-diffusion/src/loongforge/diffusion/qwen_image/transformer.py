"""diffusers' ``QwenImageTransformer2DModel`` (same parameter names and shapes, same numerics) on
packed token sequences.

Qwen-Image is a double-stream MMDiT: image and prompt tokens keep their own projections, norms,
adaLN modulations and feed-forwards, and meet in one joint attention per block, prompt first
(``[text, image]``). Here both streams are flat ``[tokens, D]`` tensors of a whole pack: the
image tokens of every sample (``PackedBatch.patches``, 2x2 latent patches in the order of
``QwenImagePipeline._pack_latents``), and the prompt tokens of every sample without their
padding (``PackedBatch.text_lengths``: where diffusers masks the padded prompt tokens out of the
keys, they are left out, which gives the image tokens the same attention). The joint attention
runs over one segment per sample, ``[its prompt, its image]``, through the packed attention
backends (``loongforge.diffusion.model.attention``).

Positions (diffusers' ``QwenEmbedRope`` with ``scale_rope``): three RoPE bands over (frame, row,
column) rotate interleaved channel pairs; an image token's rows and columns are centred
(``r - (h - h // 2)``), its frames count from 0; a sample's ``j``-th prompt token sits at
``max(h // 2, w // 2) + j`` on all three axes. Each sample has its own grid, so a pack may mix
image sizes (diffusers' batches take the first sample's). The timestep goes in as
``QwenImagePipeline`` passes it, ``t / 1000``. The output is each token's velocity in the packed
task's ``(pt, ph, pw, C)`` order (``proj_out`` computes ``(C, ph, pw)``, as the pipeline unpacks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm
from diffusers.models.transformers.transformer_qwenimage import QwenTimestepProjEmbeddings
from torch.utils.checkpoint import checkpoint

from loongforge.core.training.torch_model import TorchModel
from loongforge.diffusion.model.attention import Segments, packed_attention
from loongforge.diffusion.packing import PackedBatch
from loongforge.diffusion.qwen_image.config import CHECKPOINTING, QwenImageConfig

ROPE_THETA = 10000.0
EPS = 1e-6


@dataclass
class JointLayout:
    """Where each sample's prompt and image tokens sit in the joint sequence of a pack."""

    text_index: torch.Tensor  # [T] sample of each prompt token
    image_index: torch.Tensor  # [N] sample of each image token
    order: torch.Tensor  # [T + N] joint position -> row of cat([text, image])
    inverse: torch.Tensor  # [T + N] row of cat([text, image]) -> joint position
    segments: Segments  # one per sample: its prompt, then its image
    image_segments: Segments  # one per sample: its image tokens
    num_text: int
    text_lengths: torch.Tensor  # [B] prompt tokens of each sample
    cos: torch.Tensor  # [T + N, head_dim / 2] rotation of each channel pair, in cat([text, image]) order
    sin: torch.Tensor


def axis_frequencies(axes: list[int], device) -> list[torch.Tensor]:
    """Inverse frequencies of each RoPE band (``theta ** (-2i / width)``)."""
    return [1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, device=device, dtype=torch.float32).div(dim))
            for dim in axes]


def rope_angles(positions: torch.Tensor, axes: list[int]) -> torch.Tensor:
    """``[tokens, sum(axes) / 2]`` angles of ``[tokens, 3]`` positions (one band per axis)."""
    freqs = axis_frequencies(axes, positions.device)
    return torch.cat([positions[:, i, None].float() * f[None] for i, f in enumerate(freqs)], dim=-1)


def joint_layout(batch: PackedBatch, axes: list[int]) -> JointLayout:
    """The joint sequence of ``batch``: per sample its unpadded prompt then its image tokens."""
    device = batch.patches.device
    if batch.num_pad:
        raise ValueError("qwen_image takes packs without padding (no context parallelism)")
    lengths = (batch.text_lengths.tolist() if batch.text_lengths is not None
               else [batch.text.shape[1]] * batch.num_samples)
    image_bounds = batch.sample_bounds
    num_text = sum(lengths)
    order, bounds, text_positions = [], [0], []
    text_start = 0
    for i, ((f, h, w), n_text) in enumerate(zip(batch.grids, lengths)):
        order.append(torch.arange(text_start, text_start + n_text, device=device))
        order.append(num_text + torch.arange(image_bounds[i], image_bounds[i + 1], device=device))
        bounds.append(bounds[-1] + n_text + f * h * w)
        start = max(h // 2, w // 2)
        text_positions.append(torch.arange(start, start + n_text, device=device)[:, None].expand(n_text, 3))
        text_start += n_text
    order = torch.cat(order)
    # image rows and columns centred on the grid (diffusers' scale_rope), frames from 0
    grids = torch.tensor(batch.grids, device=device)[batch.sample_index]
    offsets = torch.stack([torch.zeros_like(grids[:, 0]), grids[:, 1] - grids[:, 1] // 2,
                           grids[:, 2] - grids[:, 2] // 2], dim=1)
    positions = torch.cat(text_positions + [batch.positions - offsets])
    angles = rope_angles(positions, axes)
    text_index = torch.repeat_interleave(torch.arange(batch.num_samples, device=device),
                                         torch.tensor(lengths, device=device))
    return JointLayout(text_index=text_index, image_index=batch.sample_index, order=order,
                       inverse=torch.argsort(order), segments=Segments(bounds), image_segments=Segments(image_bounds),
                       num_text=num_text,
                       text_lengths=torch.tensor(lengths, device=device), cos=angles.cos(), sin=angles.sin())


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved channel pairs of ``x`` ``[tokens, heads, head_dim]`` (fp32 math)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    c, s = cos[:, None], sin[:, None]
    return torch.stack([real * c - imag * s, real * s + imag * c], dim=-1).flatten(-2).type_as(x)


class JointAttention(nn.Module):
    """diffusers' ``Attention`` of a Qwen-Image block (``QwenDoubleStreamAttnProcessor2_0``):
    image projections ``to_*``, prompt projections ``add_*_proj``, per-head RMSNorm of queries
    and keys, output projections ``to_out.0`` (image) and ``to_add_out`` (prompt)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=EPS), RMSNorm(head_dim, eps=EPS)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, eps=EPS), RMSNorm(head_dim, eps=EPS)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.to_add_out = nn.Linear(inner, dim)

    def forward(self, image: torch.Tensor, text: torch.Tensor, layout: JointLayout,
                backend: str, text_out: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        def heads(t):
            return t.unflatten(-1, (-1, self.head_dim))

        k = torch.cat([self.norm_added_k(heads(self.add_k_proj(text))), self.norm_k(heads(self.to_k(image)))])
        v = torch.cat([heads(self.add_v_proj(text)), heads(self.to_v(image))])
        k = rotate_pairs(k, layout.cos, layout.sin)[layout.order]
        v = v[layout.order]
        image_q = self.norm_q(heads(self.to_q(image)))
        if not text_out:  # only the image tokens' queries: the prompt's outputs would feed nothing
            n = layout.num_text
            q = rotate_pairs(image_q, layout.cos[n:], layout.sin[n:])
            out = packed_attention(q, k, v, layout.image_segments, layout.segments, backend).flatten(1).type_as(q)
            return self.to_out[0](out), None
        q = torch.cat([self.norm_added_q(heads(self.add_q_proj(text))), image_q])
        q = rotate_pairs(q, layout.cos, layout.sin)[layout.order]
        joint = packed_attention(q, k, v, layout.segments, layout.segments, backend)
        out = joint[layout.inverse].flatten(1).type_as(q)
        return self.to_out[0](out[layout.num_text:]), self.to_add_out(out[: layout.num_text])


class QwenImageBlock(nn.Module):
    """diffusers' ``QwenImageTransformerBlock`` on the flat streams of a pack."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.attn = JointAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.img_mlp = FeedForward(dim=dim, dim_out=dim, activation_fn="gelu-approximate")
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_mlp = FeedForward(dim=dim, dim_out=dim, activation_fn="gelu-approximate")
        self.recompute = False
        self.backend = cfg.attention_backend
        self.updates_text = True  # False in the last block, whose prompt stream nothing reads

    def stop_updating_text(self) -> None:
        """The last block: its prompt tokens' queries, attention outputs and feed-forward feed
        nothing, so they are skipped and their weights frozen (they would get no gradient, which
        DDP does not allow)."""
        self.updates_text = False
        for module in (self.attn.add_q_proj, self.attn.norm_added_q, self.attn.to_add_out, self.txt_mlp):
            module.requires_grad_(False)

    def forward(self, image, text, temb, layout: JointLayout):
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, image, text, temb, layout, use_reentrant=False)
        return self._forward(image, text, temb, layout)

    @staticmethod
    def _modulated(norm: nn.LayerNorm, x: torch.Tensor, params: torch.Tensor, index: torch.Tensor):
        """``(norm(x) * (1 + scale) + shift, gate)``, each token with its sample's row of ``params``."""
        shift, scale, gate = params[index].chunk(3, dim=-1)
        return norm(x) * (1 + scale) + shift, gate

    def _forward(self, image, text, temb, layout: JointLayout):
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_in, img_gate1 = self._modulated(self.img_norm1, image, img_mod1, layout.image_index)
        txt_in, txt_gate1 = self._modulated(self.txt_norm1, text, txt_mod1, layout.text_index)
        img_attn, txt_attn = self.attn(img_in, txt_in, layout, self.backend, self.updates_text)
        image = image + img_gate1 * img_attn
        img_in, img_gate2 = self._modulated(self.img_norm2, image, img_mod2, layout.image_index)
        image = image + img_gate2 * self.img_mlp(img_in)
        if not self.updates_text:
            return image, text
        text = text + txt_gate1 * txt_attn
        txt_in, txt_gate2 = self._modulated(self.txt_norm2, text, txt_mod2, layout.text_index)
        text = text + txt_gate2 * self.txt_mlp(txt_in)
        return image, text


class QwenImageTransformer(TorchModel):
    """The packed ``QwenImageTransformer2DModel``; the family's one part, ``transformer``."""

    recompute_modes = tuple(m for m in CHECKPOINTING if m != "none")

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden_size
        self.time_text_embed = QwenTimestepProjEmbeddings(embedding_dim=dim)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim, eps=EPS)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList([QwenImageBlock(cfg) for _ in range(cfg.num_layers)])
        self.transformer_blocks[-1].stop_updating_text()
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=EPS)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_channels)

    def parts(self) -> dict[str, nn.Module]:
        return {"transformer": self}

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.transformer_blocks)

    def set_recompute(self, mode: str) -> None:
        for block in self.transformer_blocks:
            block.recompute = mode == "full"

    def forward(self, batch: PackedBatch, cp=None) -> torch.Tensor:
        if cp is not None:
            raise ValueError("qwen_image does not implement context parallelism (parallel.cp=1)")
        cfg = self.config
        layout = joint_layout(batch, list(cfg.axes_dims_rope))
        image = self.img_in(batch.patches)
        valid = torch.arange(batch.text.shape[1], device=image.device)[None] < layout.text_lengths[:, None]
        text = batch.text[valid]  # [T, text_dim]: the prompts without their padding
        text = self.txt_in(self.txt_norm(text))
        temb = self.time_text_embed((batch.timesteps / 1000.0).to(image.dtype), image)
        for block in self.transformer_blocks:
            image, text = block(image, text, temb, layout)
        scale, shift = self.norm_out.linear(self.norm_out.silu(temb)).to(image.dtype).chunk(2, dim=1)
        image = self.norm_out.norm(image) * (1 + scale[layout.image_index]) + shift[layout.image_index]
        out = self.proj_out(image)  # [N, C * p * p] in (C, ph, pw) order
        p = cfg.patch_size
        return out.unflatten(1, (cfg.out_channels, p, p)).permute(0, 2, 3, 1).flatten(1)
