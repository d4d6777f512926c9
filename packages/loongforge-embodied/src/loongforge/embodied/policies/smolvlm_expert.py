"""SmolVLA's backbone: SmolVLM's Llama-style text layers paired with a narrower action expert.

Layer ``i`` holds the VLM's block and the expert's block (same heads, head size and depth; the
expert is narrower). Every ``self_attn_every_n_layers``-th layer (0, n, 2n, ...) attends jointly:
the expert's queries see the prefix's keys/values and its own, under one block-causal mask. The
other layers cross-attend: the expert's ``k_proj``/``v_proj`` read the VLM's (rotated) keys and
values of the prefix, so their input width is the VLM's key/value width, and the expert's queries
are rotated at positions counted from 0 within the suffix. The prefix never sees the suffix, so
its attention is computed over the prefix alone (equal to the joint computation, whose suffix
columns are masked out).

Blocks are Llama's: RMSNorm (``weight * x / rms``), grouped-query attention with rotate-half RoPE,
a SwiGLU MLP, no biases.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.core.kernels import get_kernel
from loongforge.embodied.config import GemmaConfig
from loongforge.embodied.policies.layers import attention


class LlamaRMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps)``, weight initialised to 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._rms_norm = get_kernel("rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttentionProj(nn.Module):
    """Query/key/value/output projections; keys and values read ``kv_in`` features (the block's
    width, or the VLM's key/value width in a cross-attention layer of the expert)."""

    def __init__(self, cfg: GemmaConfig, kv_in: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv_in = kv_in or cfg.width
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def q(self, h: torch.Tensor) -> torch.Tensor:
        return self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))

    def kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_kv_heads, self.head_dim)
        return self.k_proj(h).unflatten(-1, shape), self.v_proj(h).unflatten(-1, shape)


class LlamaBlock(nn.Module):
    """One decoder layer's parameters; the attention itself is computed by ``SmolVLMExpertLayer``."""

    def __init__(self, cfg: GemmaConfig, kv_in: int | None = None):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.width, cfg.rms_norm_eps)
        self.self_attn = LlamaAttentionProj(cfg, kv_in)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.width, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.width, cfg.mlp_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and the MLP, given the attention output ``[B, T, H*D]``."""
        x = x + self.self_attn.o_proj(attn.to(self.self_attn.o_proj.weight.dtype))
        return x + self.mlp(self.post_attention_layernorm(x))


class SmolVLMExpertLayer(nn.Module):
    """Layer ``i`` of the VLM and of the expert: joint attention (``cross=False``) or the expert
    cross-attending to the prefix (``cross=True``)."""

    def __init__(self, vlm: GemmaConfig, expert: GemmaConfig, cross: bool):
        super().__init__()
        self.cross = cross
        self.vlm = LlamaBlock(vlm)
        self.expert = LlamaBlock(expert, kv_in=vlm.num_kv_heads * vlm.head_dim if cross else None)
        self.scale = vlm.head_dim**-0.5
        self._rope = get_kernel("rope")

    def prefix_kv(self, prefix: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The prefix's normed input, rotated queries and rotated keys/values."""
        h = self.vlm.input_layernorm(prefix)
        k, v = self.vlm.self_attn.kv(h)
        return self._rope(self.vlm.self_attn.q(h), cos, sin), (self._rope(k, cos, sin), v)

    def forward(
        self,
        prefix: torch.Tensor | None,
        suffix: torch.Tensor | None,
        prefix_rope: tuple[torch.Tensor, torch.Tensor],
        suffix_rope: tuple[torch.Tensor, torch.Tensor],
        masks: dict[str, torch.Tensor],
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        prefix_output: bool = True,
    ):
        """``prefix [B, P, W]`` (or None with its cached ``prefix_kv``), ``suffix [B, S, E]`` (or
        None); ``suffix_rope`` is at the joint positions in a joint layer and at positions from 0 in
        a cross layer; ``masks`` holds additive ``pp [B,1,P,P]``, ``sp [B,1,S,P]``, ``ss [B,1,S,S]``.
        Returns ``(prefix out or None, suffix out or None, this layer's prefix (k, v))``."""
        prefix_out = None
        if prefix is not None:
            q_p, prefix_kv = self.prefix_kv(prefix, *prefix_rope)
            if prefix_output:
                prefix_out = self.vlm.finish(prefix, attention(q_p, *prefix_kv, masks["pp"], self.scale))
        suffix_out = None
        if suffix is not None:
            blk = self.expert
            h = blk.input_layernorm(suffix)
            q_s = self._rope(blk.self_attn.q(h), *suffix_rope)
            assert prefix_kv is not None, "the suffix attends to the prefix: give it or its cached keys/values"
            k_p, v_p = prefix_kv
            if self.cross:  # the expert's key/value projections of the prefix's keys/values
                k = blk.self_attn.k_proj(k_p.flatten(-2).to(h.dtype)).unflatten(-1, (-1, blk.self_attn.head_dim))
                v = blk.self_attn.v_proj(v_p.flatten(-2).to(h.dtype)).unflatten(-1, (-1, blk.self_attn.head_dim))
                mask = masks["sp"]
            else:
                k_s, v_s = blk.self_attn.kv(h)
                k = torch.cat([k_p, self._rope(k_s, *suffix_rope)], 1)
                v = torch.cat([v_p, v_s], 1)
                mask = torch.cat([masks["sp"], masks["ss"]], -1)
            suffix_out = blk.finish(suffix, attention(q_s, k.to(q_s.dtype), v.to(q_s.dtype), mask, self.scale))
        return prefix_out, suffix_out, prefix_kv
