"""The Wan 2.x DiT over packed token sequences.

Parameters carry exactly the names and shapes of diffusers' ``WanTransformer3DModel`` (text-to-video
variants), so ``load_state_dict`` of a diffusers checkpoint is the identity mapping (see
``model/convert.py``). The forward differs where training needs it:

- inputs are a ``PackedBatch``: several videos of different sizes in one sequence; self-attention
  and cross-attention respect per-sample boundaries, each sample has its own timestep, prompt and
  3D RoPE grid;
- patch embedding is one GEMM over the packed patches (the Conv3d's kernel equals its stride);
- query/key RMSNorm and RoPE go through the core kernel registry (``rms_norm``, ``rope``), so
  fused kernels run where installed;
- with a ``ContextParallel`` group each rank computes its slice of the tokens, exchanging heads for
  sequence around self-attention (Ulysses);
- per-block activation checkpointing.

The embedding modules that have nothing to do with packing (time/text embedder, LayerNorms,
GELU feed-forward) are diffusers' own modules, so their numerics are diffusers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding
from torch.utils.checkpoint import checkpoint

from loongforge.core.kernels import get_kernel
from loongforge.diffusion.context_parallel import ContextParallel, heads_to_seq, seq_to_heads
from loongforge.diffusion.model.attention import Segments, packed_attention
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.model.rope import rope_tables, to_rotate_half
from loongforge.diffusion.packing import PackedBatch, pack, unpack_outputs


@dataclass
class TokenContext:
    """What every block needs about this rank's tokens (built once per forward)."""

    sample_index: torch.Tensor  # [n] sample of each local token
    rope_cos: torch.Tensor  # [n, head_dim]
    rope_sin: torch.Tensor
    self_segments: Segments  # samples (and padding) of the full sequence (after the Ulysses all-to-all)
    cross_q_segments: Segments  # local token segments, one per locally present sample
    cross_k_segments: Segments  # their prompt rows in text[first_sample:last_sample + 1]
    first_sample: int
    last_sample: int
    single_sample: bool
    backend: str
    cp: ContextParallel | None

    def per_token(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` -> broadcastable per-token ``[n or 1, ...]``."""
        return per_sample[:1] if self.single_sample else per_sample[self.sample_index]


def _local_cross_bounds(bounds: list[int], lo: int, hi: int) -> tuple[list[int], int, int]:
    """Clip global per-sample bounds to the local token range [lo, hi)."""
    first = max(i for i in range(len(bounds) - 1) if bounds[i] <= lo)
    last = max(i for i in range(len(bounds) - 1) if bounds[i] < hi)
    q = [0] + [min(max(b, lo), hi) - lo for b in bounds[first + 1 : last + 1]] + [hi - lo]
    return q, first, last


class WanAttention(nn.Module):
    """Self- or cross-attention with diffusers' ``WanAttention`` parameters (to_q/k/v, to_out.0,
    norm_q/norm_k RMSNorm across heads)."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, dim // heads, eps
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def forward(self, x: torch.Tensor, tc: TokenContext, text: torch.Tensor | None = None) -> torch.Tensor:
        rms_norm = get_kernel("rms_norm")
        # cross-attention reads the prompts of the samples present in this rank's tokens
        source = x if text is None else text[tc.first_sample : tc.last_sample + 1].flatten(0, 1)
        q = self._heads(rms_norm(self.to_q(x), self.norm_q.weight, self.eps))
        k = self._heads(rms_norm(self.to_k(source), self.norm_k.weight, self.eps))
        v = self._heads(self.to_v(source))
        if text is None:
            rope = get_kernel("rope")
            q = rope(to_rotate_half(q), tc.rope_cos, tc.rope_sin)
            k = rope(to_rotate_half(k), tc.rope_cos, tc.rope_sin)
            if tc.cp is not None:
                q, k, v = (seq_to_heads(t, tc.cp) for t in (q, k, v))
            out = packed_attention(q, k, v, tc.self_segments, tc.self_segments, tc.backend)
            if tc.cp is not None:
                out = heads_to_seq(out, tc.cp)
        else:
            out = packed_attention(q, k, v, tc.cross_q_segments, tc.cross_k_segments, tc.backend)
        return self.to_out[0](out.flatten(1).type_as(x))


class WanBlock(nn.Module):
    """diffusers' ``WanTransformerBlock`` (same parameters and numerics) on packed tokens."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.norm1 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, cfg.num_attention_heads, cfg.eps)
        self.attn2 = WanAttention(dim, cfg.num_attention_heads, cfg.eps)
        self.norm2 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, tc: TokenContext) -> torch.Tensor:
        # temb: [B, 6, dim] per sample; modulation per token via the sample index
        mod = tc.per_token(self.scale_shift_table + temb.float())
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = mod.unbind(1)

        h = (self.norm1(x.float()) * (1 + scale_msa) + shift_msa).type_as(x)
        x = (x.float() + self.attn1(h, tc) * gate_msa).type_as(x)

        h = self.norm2(x.float()).type_as(x)
        x = x + self.attn2(h, tc, text)

        h = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


class WanDiT(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden_size
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=tuple(cfg.patch_size), stride=tuple(cfg.patch_size))
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim=dim, time_freq_dim=cfg.freq_dim, time_proj_dim=dim * 6, text_embed_dim=cfg.text_dim
        )
        self.blocks = nn.ModuleList([WanBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * cfg.patch_volume)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.activation_checkpointing = cfg.activation_checkpointing

    def token_context(self, batch: PackedBatch, cp: ContextParallel | None, device) -> tuple[TokenContext, int, int]:
        n = batch.num_tokens
        lo, hi = cp.local_range(n) if cp is not None else (0, n)
        cross_q, first, last = _local_cross_bounds(batch.cross_attention_bounds, lo, hi)
        L = batch.text.shape[1]
        positions = batch.positions[lo:hi].to(device)
        cos, sin = rope_tables(positions, self.config.attention_head_dim)
        tc = TokenContext(
            sample_index=batch.sample_index[lo:hi].to(device),
            rope_cos=cos,
            rope_sin=sin,
            self_segments=Segments(batch.self_attention_bounds),
            cross_q_segments=Segments(cross_q),
            cross_k_segments=Segments([i * L for i in range(last - first + 2)]),
            first_sample=first,
            last_sample=last,
            single_sample=batch.num_samples == 1,
            backend=self.config.attention_backend,
            cp=cp,
        )
        return tc, lo, hi

    def forward(self, batch: PackedBatch, cp: ContextParallel | None = None) -> torch.Tensor:
        """Predicted velocity for this rank's tokens: ``[n, pt*ph*pw*out_channels]``."""
        weight = self.patch_embedding.weight
        tc, lo, hi = self.token_context(batch, cp, weight.device)
        x = F.linear(batch.patches[lo:hi].to(weight.device, weight.dtype), weight.flatten(1), self.patch_embedding.bias)

        temb, timestep_proj, text, _ = self.condition_embedder(batch.timesteps.to(weight.device), batch.text.to(weight.device, weight.dtype))
        timestep_proj = timestep_proj.unflatten(1, (6, -1))

        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, text, timestep_proj, tc, use_reentrant=False)
            else:
                x = block(x, text, timestep_proj, tc)

        shift, scale = tc.per_token(self.scale_shift_table + temb.unsqueeze(1)).unbind(1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return self.proj_out(x)

    def forward_video(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """diffusers' calling convention: ``[B, C, F, H, W]`` latents -> ``[B, C_out, F, H, W]``."""
        batch = pack(list(hidden_states), timestep, encoder_hidden_states, self.config.patch_size)
        out = self.forward(batch)
        return torch.stack(unpack_outputs(out, batch, self.config.patch_size))
