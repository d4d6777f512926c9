"""Transformer pieces of the policies: Gemma-style blocks that can attend jointly across two
streams (backbone prefix + action-expert suffix), RoPE, adaptive RMSNorm, attention masks."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.core.kernels import get_kernel
from loongforge.embodied.config import GemmaConfig

# Additive mask value of masked positions: finite, so fully-masked rows (padding) stay finite.
MASK_VALUE = -2.3819763e38


class RMSNorm(nn.Module):
    """Gemma RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, weight initialised to 0."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._rms_norm = get_kernel("rms_norm")

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self._rms_norm(x, 1.0 + self.weight.float(), self.eps), None


class AdaRMSNorm(nn.Module):
    """Adaptive RMSNorm (Pi0.5): ``cond`` gives per-sample scale, shift and a residual gate."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cond is None:
            raise ValueError("AdaRMSNorm needs a conditioning vector")
        mod = self.dense(cond)
        if x.dim() == 3:
            mod = mod[:, None, :]
        scale, shift, gate = mod.chunk(3, dim=-1)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttentionProj(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, heads, head_dim]`` projections (kv with ``num_kv_heads``)."""
        b, t, _ = h.shape
        return (
            self.q_proj(h).view(b, t, self.num_heads, self.head_dim),
            self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim),
            self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim),
        )


class GemmaBlock(nn.Module):
    """One decoder layer's parameters; the attention itself is computed by ``JointLayer``."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()
        norm = (lambda: AdaRMSNorm(cfg.width, cond_dim, cfg.rms_norm_eps)) if cond_dim else (lambda: RMSNorm(cfg.width, cfg.rms_norm_eps))
        self.input_layernorm = norm()
        self.self_attn = GemmaAttentionProj(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = GemmaMLP(cfg.width, cfg.mlp_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate, cond) -> torch.Tensor:
        """Output projection, gated residuals and the MLP, given the attention output ``[B, T, H*D]``."""
        x = gated_residual(x, self.self_attn.o_proj(attn.to(self.self_attn.o_proj.weight.dtype)), gate)
        h, gate2 = self.post_attention_layernorm(x, cond)
        return gated_residual(x, self.mlp(h), gate2)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, head_dim]`` cos/sin of rotate-half RoPE at integer ``positions`` ``[B, T]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, Tq, H, D]``, ``k/v [B, Tk, KV, D]``, additive ``mask [B, 1, Tq, Tk]`` -> ``[B, Tq, H*D]``.

    Key/value heads are repeated to the query heads (each serves ``H / KV`` consecutive query
    heads) so the masked SDPA can use the memory-efficient kernel on GPUs."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.to(q.dtype), scale=scale
    )
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


class JointLayer(nn.Module):
    """Layer ``i`` of the backbone and (optionally) of the action expert, attending jointly.

    Each stream uses its own norms and projections; queries, keys and values of both streams
    are concatenated along the sequence so the suffix attends to the prefix under one mask
    (Pi0's mixture of transformers). With ``prefix_kv`` the prefix's cached keys/values stand in
    for a prefix stream (inference after one prefix pass); ``prefix_output=False`` skips the
    prefix's output projection and MLP when only its keys/values are needed (the last layer).
    """

    def __init__(self, vlm: GemmaConfig, expert: GemmaConfig | None = None, expert_cond_dim: int | None = None):
        super().__init__()
        self.vlm = GemmaBlock(vlm)
        self.expert = GemmaBlock(expert, expert_cond_dim) if expert is not None else None
        self.scale = vlm.head_dim**-0.5
        self._rope = get_kernel("rope")  # resolved once: the fused op when installed, else the reference

    def forward(
        self,
        prefix: torch.Tensor | None,
        suffix: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cond: torch.Tensor | None = None,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        prefix_output: bool = True,
    ):
        rope = self._rope
        streams: list[tuple[GemmaBlock, torch.Tensor, torch.Tensor | None]] = []
        if prefix is not None:
            streams.append((self.vlm, prefix, None))
        if suffix is not None:
            assert self.expert is not None  # only a layer built with an expert is given a suffix
            streams.append((self.expert, suffix, cond))
        qs, ks, vs, gates, lens = [], [], [], [], []
        for blk, x, c in streams:
            h, gate = blk.input_layernorm(x, c)
            q, k, v = blk.self_attn.qkv(h)
            qs.append(q)
            ks.append(k)
            vs.append(v)
            gates.append(gate)
            lens.append(x.shape[1])
        q, k, v = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        new_kv = (k, v) if prefix is not None else None
        if prefix_kv is not None:
            k, v = torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1)
        out = attention(q, k, v, mask, self.scale)
        outs, start = [], 0
        for (blk, x, c), gate, n in zip(streams, gates, lens):
            skip = blk is self.vlm and not prefix_output  # nothing downstream reads it
            outs.append(None if skip else blk.finish(x, out[:, start : start + n], gate, c))
            start += n
        prefix_out = outs.pop(0) if prefix is not None else None
        suffix_out = outs.pop(0) if suffix is not None else None
        return prefix_out, suffix_out, new_kv


def make_att_2d_masks(pad: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
    """Block-causal masks (big_vision convention): token i attends to valid token j when
    ``cumsum(att)[j] <= cumsum(att)[i]``; ``att`` is 1 where a new causal block starts."""
    cum = torch.cumsum(att.long(), dim=1)
    return (cum[:, None, :] <= cum[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """bool ``[B, Tq, Tk]`` -> additive float ``[B, 1, Tq, Tk]``."""
    return torch.where(allowed[:, None], 0.0, MASK_VALUE)


def init_linear_weights(module: nn.Module, std: float = 0.02, skip: tuple[nn.Module, ...] = ()) -> None:
    """Normal(0, std) weights, zero biases, for every ``nn.Linear``/``nn.Embedding`` under ``module``
    except adaptive-norm projections (which start at zero) and modules under ``skip`` (which
    keep their own initialisation)."""
    skipped = {id(p) for s in skip for p in s.parameters()}
    for name, m in module.named_modules():
        if any(id(p) in skipped for p in m.parameters(recurse=False)):
            continue
        if isinstance(m, nn.Linear) and not name.endswith("dense"):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)


def embed_scale(width: int) -> float:
    return math.sqrt(width)
