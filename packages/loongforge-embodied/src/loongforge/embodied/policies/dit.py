"""DiT blocks of the GR00T-style action head: adaLN-zero timestep conditioning of self-attention
and MLP, plus cross-attention from the action tokens to the backbone features."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.embodied.config import positive


@dataclass
class DiTConfig:
    """The GR00T-style action head: DiT blocks with adaLN timestep conditioning and cross-attention."""

    width: int = 64  # hidden size of the DiT blocks
    depth: int = 2  # DiT blocks
    num_heads: int = 4  # attention heads
    mlp_ratio: float = 4.0  # MLP hidden width as a multiple of width
    vlm_layer: int = -1  # backbone layer whose hidden states the head attends to (-1 = last)

    def __post_init__(self):
        positive("model.dit", self, "width", "depth", "num_heads")
        if self.width % self.num_heads:
            raise ValueError(f"model.dit.width={self.width} not divisible by num_heads={self.num_heads}")


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class MultiHeadAttention(nn.Module):
    def __init__(self, width: int, heads: int, kv_width: int | None = None):
        super().__init__()
        kv_width = kv_width or width
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(kv_width, width)
        self.v = nn.Linear(kv_width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, w = x.shape
        split = lambda y: y.view(b, y.shape[1], self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(context)), split(self.v(context))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype))
        return self.out(out.transpose(1, 2).reshape(b, t, w))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        w = cfg.width
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.self_attn = MultiHeadAttention(w, cfg.num_heads)
        self.norm_cross = nn.LayerNorm(w, eps=1e-6)
        self.cross_attn = MultiHeadAttention(w, cfg.num_heads)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        hidden = int(w * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(w, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, w))
        self.ada = nn.Linear(w, 6 * w)  # shift/scale/gate for attention and MLP

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        s1, c1, g1, s2, c2, g2 = self.ada(F.silu(temb)).chunk(6, dim=-1)
        h = modulate(self.norm1(x), s1, c1)
        x = x + g1[:, None] * self.self_attn(h, h)
        x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        return x + g2[:, None] * self.mlp(modulate(self.norm2(x), s2, c2))


def zero_init_adaln(block: DiTBlock) -> None:
    nn.init.zeros_(block.ada.weight)
    nn.init.zeros_(block.ada.bias)
