"""GR00T N1.7's flow-matching action head (LeRobot's ``GR00TN17ActionHead``), module for module.

Backbone features are layer-normed (``vlln``) and refined by self-attention blocks
(``vl_self_attention``). The state goes through an embodiment-specific two-layer MLP (one token);
the noisy action chunk through the embodiment-specific action encoder (linear, concatenated with a
sinusoidal embedding of the discretised time, swish, linear, linear) plus learned positions. The
state and action tokens run through the DiT (``model``): adaLN blocks conditioned on the
discretised time, alternating cross-attention to the backbone features (every
``2 * attend_text_every_n_blocks``-th block to the text tokens, the other cross blocks to the image
tokens) with self-attention; a final adaLN and projection. An embodiment-specific MLP decodes the
velocity at the action tokens.

GR00T's time runs the other way from the rest of this package: ``tau = 1`` is data,
``x = (1 - tau) * noise + tau * actions`` and the velocity is ``actions - noise``; the head takes
``tau`` and its bucket ``int(tau * num_timestep_buckets)`` as LeRobot computes them. Parameter
names are LeRobot's (diffusers' ``Attention``/``FeedForward``/``TimestepEmbedding`` names inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.embodied.config import positive


@dataclass
class GrootHeadConfig:
    """The sizes of GR00T N1.7's action head (LeRobot's ``GR00TN17Config`` names in comments)."""

    hidden_size: int = 32  # hidden_size: the state encoder / action decoder width and the DiT's output
    input_embedding_dim: int = 32  # input_embedding_dim: the state/action token width (= dit_heads * dit_head_dim)
    dit_layers: int = 4  # diffusion_model_cfg.num_layers
    dit_heads: int = 2  # diffusion_model_cfg.num_attention_heads
    dit_head_dim: int = 16  # diffusion_model_cfg.attention_head_dim
    vl_layers: int = 1  # vl_self_attention_cfg.num_layers (0: none)
    vl_heads: int = 4  # vl_self_attention_cfg.num_attention_heads
    vl_head_dim: int = 16  # vl_self_attention_cfg.attention_head_dim (heads * head_dim = backbone width)
    attend_text_every_n_blocks: int = 2  # attend_text_every_n_blocks
    dropout: float = 0.0  # diffusion_model_cfg.dropout and vl_self_attention_cfg.dropout (released: 0.2)
    max_seq_len: int = 1024  # max_seq_len: learned positions of the action tokens
    max_num_embodiments: int = 32  # max_num_embodiments: rows of the embodiment-specific layers
    embodiment_id: int = 0  # the row this policy trains and runs
    num_timestep_buckets: int = 1000  # num_timestep_buckets: the DiT sees int(tau * buckets)
    state_dropout_prob: float = 0.0  # state_dropout_prob: training zeroes the state token this often

    def __post_init__(self):
        positive("model.head", self, "hidden_size", "input_embedding_dim", "dit_layers", "dit_heads", "dit_head_dim",
                 "vl_heads", "vl_head_dim", "attend_text_every_n_blocks", "max_seq_len", "max_num_embodiments",
                 "num_timestep_buckets")
        if self.dit_heads * self.dit_head_dim != self.input_embedding_dim:
            raise ValueError(f"model.head.dit_heads * dit_head_dim = {self.dit_heads * self.dit_head_dim} must equal "
                             f"input_embedding_dim={self.input_embedding_dim}")
        if not 0 <= self.embodiment_id < self.max_num_embodiments:
            raise ValueError(f"model.head.embodiment_id={self.embodiment_id}: not below max_num_embodiments="
                             f"{self.max_num_embodiments}")


class CategorySpecificLinear(nn.Module):
    """One ``[in, out]`` weight and ``[out]`` bias per embodiment (``W [E, in, out]``, ``b [E, out]``)."""

    def __init__(self, categories: int, dim_in: int, dim_out: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(categories, dim_in, dim_out))
        self.b = nn.Parameter(torch.zeros(categories, dim_out))

    def forward(self, x: torch.Tensor, category: int) -> torch.Tensor:
        return x @ self.W[category] + self.b[category]


class CategorySpecificMLP(nn.Module):
    def __init__(self, categories: int, dim_in: int, hidden: int, dim_out: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(categories, dim_in, hidden)
        self.layer2 = CategorySpecificLinear(categories, hidden, dim_out)

    def forward(self, x: torch.Tensor, category: int) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, category)), category)


def sincos(positions: torch.Tensor, dim: int, first: str = "sin") -> torch.Tensor:
    """``[..., dim]`` features of ``positions`` at frequencies ``10000^(-i / half)``; ``first`` says
    whether the sines (GR00T's action encoder) or the cosines (diffusers' flipped timesteps) lead."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angle = positions.float()[..., None] * freqs
    parts = [torch.sin(angle), torch.cos(angle)]
    return torch.cat(parts if first == "sin" else parts[::-1], dim=-1)


class ActionEncoder(nn.Module):
    """GR00T's ``MultiEmbodimentActionEncoder``: ``W3(swish(W2([W1(a), sincos(tau bucket)])))``."""

    def __init__(self, action_dim: int, width: int, categories: int):
        super().__init__()
        self.width = width
        self.W1 = CategorySpecificLinear(categories, action_dim, width)
        self.W2 = CategorySpecificLinear(categories, 2 * width, width)
        self.W3 = CategorySpecificLinear(categories, width, width)

    def forward(self, actions: torch.Tensor, buckets: torch.Tensor, category: int) -> torch.Tensor:
        emb = self.W1(actions, category)
        temb = sincos(buckets[:, None].expand(-1, actions.shape[1]), self.width).to(emb.dtype)
        return self.W3(F.silu(self.W2(torch.cat([emb, temb], -1), category)), category)


class TimestepEmbedder(nn.Module):
    """diffusers' ``TimestepEmbedding`` (``linear_1``, swish, ``linear_2``)."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim_in, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEncoder(nn.Module):
    """The DiT's time condition: 256 cosine-first sinusoidal features of the bucket (diffusers'
    ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)``), then an MLP."""

    CHANNELS = 256

    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(self.CHANNELS, dim)

    def forward(self, buckets: torch.Tensor) -> torch.Tensor:
        half = self.CHANNELS // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=buckets.device) / (half - 1))
        angle = buckets.float()[:, None] * freqs[None]
        feats = torch.cat([torch.cos(angle), torch.sin(angle)], -1)
        return self.timestep_embedder(feats.to(self.timestep_embedder.linear_1.weight.dtype))


class Attention(nn.Module):
    """diffusers' ``Attention`` as GR00T uses it: biased projections, output projection and dropout
    (``to_out``), keys/values from ``context_dim`` features; ``mask [B, S]`` (True: attend)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float, context_dim: int | None = None):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(context_dim or dim, inner)
        self.to_v = nn.Linear(context_dim or dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(dropout)])

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b = x.shape[0]
        split = lambda y: y.view(b, y.shape[1], self.heads, -1).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(context)), split(self.to_v(context)),
                                             attn_mask=None if mask is None else mask[:, None, None, :])
        out = out.transpose(1, 2).flatten(2)
        return self.to_out[1](self.to_out[0](out))


class GeluFeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="gelu-approximate", final_dropout=True)``:
    ``net = [GELU(proj), Dropout, Linear, Dropout]``."""

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, 4 * dim)
        self.net = nn.ModuleList([proj, nn.Dropout(dropout), nn.Linear(4 * dim, dim), nn.Dropout(dropout)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](F.gelu(self.net[0].proj(x), approximate="tanh"))
        return self.net[3](self.net[2](h))


class AdaLayerNorm(nn.Module):
    """``LayerNorm(x) * (1 + scale) + shift`` with ``(scale, shift) = linear(swish(temb))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class TransformerBlock(nn.Module):
    """GR00T's ``BasicTransformerBlock``: norm, attention (self, or cross to ``context``), dropout,
    residual; norm, feed-forward, residual. ``ada`` conditions the first norm on the time (the DiT);
    otherwise both norms are affine LayerNorms (the backbone features' self-attention)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float, context_dim: int | None, ada: bool):
        super().__init__()
        self.norm1 = AdaLayerNorm(dim) if ada else nn.LayerNorm(dim, eps=1e-5)
        self.attn1 = Attention(dim, heads, head_dim, dropout, context_dim)
        self.final_dropout = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=not ada)
        self.ff = GeluFeedForward(dim, dropout)

    def forward(self, x, temb=None, context=None, mask=None):
        h = self.norm1(x, temb) if isinstance(self.norm1, AdaLayerNorm) else self.norm1(x)
        x = x + self.final_dropout(self.attn1(h, context, mask))
        return x + self.ff(self.norm3(x))


class AlternateVLDiT(nn.Module):
    """GR00T N1.7's DiT: odd blocks self-attend; even blocks cross-attend to the backbone's text
    tokens (every ``2 * attend_text_every_n_blocks``-th block) or image tokens (the others)."""

    def __init__(self, cfg: GrootHeadConfig, context_dim: int):
        super().__init__()
        dim = cfg.input_embedding_dim
        self.attend_text_every_n_blocks = cfg.attend_text_every_n_blocks
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList([
            TransformerBlock(dim, cfg.dit_heads, cfg.dit_head_dim, cfg.dropout, None if i % 2 else context_dim, ada=True)
            for i in range(cfg.dit_layers)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, cfg.hidden_size)

    def forward(self, x, context, buckets, image_mask, context_mask, block=None):
        temb = self.timestep_encoder(buckets)
        text, image = (~image_mask) & context_mask, image_mask & context_mask
        run = block or (lambda blk, *args: blk(*args))
        for i, blk in enumerate(self.transformer_blocks):
            if i % 2:
                x = run(blk, x, temb)
            else:
                x = run(blk, x, temb, context, text if i % (2 * self.attend_text_every_n_blocks) == 0 else image)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)
        return self.proj_out_2(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])


class VLSelfAttention(nn.Module):
    """GR00T's ``SelfAttentionTransformer`` over the backbone features."""

    def __init__(self, cfg: GrootHeadConfig, dim: int):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([TransformerBlock(dim, cfg.vl_heads, cfg.vl_head_dim, cfg.dropout, None,
                                                                  ada=False) for _ in range(cfg.vl_layers)])

    def forward(self, x: torch.Tensor, block=None) -> torch.Tensor:
        run = block or (lambda blk, *args: blk(*args))
        for blk in self.transformer_blocks:
            x = run(blk, x)
        return x


class GrootActionHead(nn.Module):
    """GR00T N1.7's action head (see the module docstring); ``backbone_dim`` is the width of the
    backbone features it reads (LeRobot's ``backbone_embedding_dim``)."""

    def __init__(self, cfg: GrootHeadConfig, backbone_dim: int, state_dim: int, action_dim: int):
        super().__init__()
        if cfg.vl_layers and cfg.vl_heads * cfg.vl_head_dim != backbone_dim:
            raise ValueError(f"model.head.vl_heads * vl_head_dim = {cfg.vl_heads * cfg.vl_head_dim} must equal the "
                             f"backbone width {backbone_dim}")
        self.cfg = cfg
        self.model = AlternateVLDiT(cfg, backbone_dim)
        self.state_encoder = CategorySpecificMLP(cfg.max_num_embodiments, state_dim, cfg.hidden_size, cfg.input_embedding_dim)
        self.action_encoder = ActionEncoder(action_dim, cfg.input_embedding_dim, cfg.max_num_embodiments)
        self.action_decoder = CategorySpecificMLP(cfg.max_num_embodiments, cfg.hidden_size, cfg.hidden_size, action_dim)
        self.vlln = nn.LayerNorm(backbone_dim)
        self.vl_self_attention = VLSelfAttention(cfg, backbone_dim)
        self.position_embedding = nn.Embedding(cfg.max_seq_len, cfg.input_embedding_dim)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.vl_self_attention.transformer_blocks) + list(self.model.transformer_blocks)

    def buckets(self, tau: torch.Tensor) -> torch.Tensor:
        return (tau * self.cfg.num_timestep_buckets).long()

    def encode(self, features: torch.Tensor, state: torch.Tensor, block=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The refined backbone features and the state token ``[B, 1, input_embedding_dim]``."""
        feats = self.vl_self_attention(self.vlln(features), block)
        state_tok = self.state_encoder(state[:, None, :].to(feats.dtype), self.cfg.embodiment_id)
        if self.training and self.cfg.state_dropout_prob > 0:
            keep = torch.rand(state_tok.shape[0], device=state_tok.device) >= self.cfg.state_dropout_prob
            state_tok = state_tok * keep[:, None, None].to(state_tok.dtype)
        return feats, state_tok

    def velocity(self, feats, state_tok, x, buckets, image_mask, context_mask, block=None) -> torch.Tensor:
        """GR00T's velocity ``d x / d tau`` ``[B, chunk, action_dim]`` at the noisy chunk ``x``."""
        e = self.cfg.embodiment_id
        tokens = self.action_encoder(x.to(feats.dtype), buckets, e)
        tokens = tokens + self.position_embedding.weight[None, : tokens.shape[1]]
        out = self.model(torch.cat([state_tok, tokens], 1), feats, buckets, image_mask, context_mask, block)
        return self.action_decoder(out, e)[:, -x.shape[1]:]
