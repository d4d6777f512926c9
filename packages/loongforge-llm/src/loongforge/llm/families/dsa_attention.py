"""Multi-head latent attention (MLA) with DeepSeek-V3.2 sparse attention (DSA), as one module.

A standalone building block for DeepSeek-V3-family models: the projections of MLA
(low-rank queries, one compressed latent KV per token plus a shared rope key), the lightning
indexer, and three ways to run the attention:

- ``dense``: plain causal MLA (per-head keys and values expanded from the latent, SDPA);
- ``warmup``: the dense attention, plus the indexer's KL loss against it over every causal key
  (DSA's first training stage, where only the indexer learns);
- ``sparse``: the indexer picks ``index_topk`` keys per query and attention runs in MLA's absorbed
  form over those only (queries are mapped into the latent space, the latent rows are the keys
  and values), plus the indexer's KL loss over the selected keys.

The indexer reads detached inputs, so its loss trains only the indexer and the language-model
loss never reaches it. All heavy ops come from the kernel registry, resolved when the module is
built under its ``KernelPolicy``, so fused Triton kernels run where they are installed and
supported (and not forced off), torch references elsewhere. The DSA ops' contracts are
loongforge-llm's (``loongforge.llm.ops.dsa``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.ops.dsa import absorb_query

MODES = ("dense", "warmup", "sparse")

# The sparse stage's indexer-loss target is computed for chunks of queries whose absorbed queries
# ([chunk, heads, latent + rope]) hold about this many elements (512 MiB in bf16)
TARGET_CHUNK_ELEMENTS = 1 << 28


@dataclass
class DSAConfig:
    """Sizes of one MLA + DSA attention layer (defaults: DeepSeek-V3.2's per-head sizes)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"DSAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DSAConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"DSAConfig.index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim="
                f"{self.qk_rope_head_dim} (the indexer ropes its first qk_rope_head_dim dims)"
            )

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


def rope_tables(n: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` ``[n, dim]`` for positions ``0..n-1`` (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


class DSAttention(nn.Module):
    """MLA attention with a lightning indexer; ``forward`` returns ``(output, indexer_loss or None)``.
    ``kernels``: the policy its registry ops are resolved by."""

    def __init__(self, config: DSAConfig, kernels: KernelPolicy = KernelPolicy()):
        super().__init__()
        c = self.config = config
        self._rms_norm, self._rope = kernels.get("rms_norm"), kernels.get("rope")
        self._indexer_topk, self._indexer_loss = kernels.get("dsa_indexer_topk"), kernels.get("dsa_indexer_loss")
        self._sparse_attention = kernels.get("sparse_mla_absorbed_attention")
        h = c.num_heads
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = nn.Parameter(torch.ones(c.q_lora_rank))
        self.wq_b = nn.Linear(c.q_lora_rank, h * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False)
        self.wkv_a = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(c.kv_lora_rank))
        self.wkv_b = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=False)
        # the lightning indexer
        self.wq_index = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.wk_index = nn.Linear(c.hidden_size, c.index_head_dim, bias=False)
        self.k_index_norm = nn.LayerNorm(c.index_head_dim)
        self.w_index = nn.Linear(c.hidden_size, c.index_n_heads, bias=False)

    def indexer_parameters(self) -> list[nn.Parameter]:
        """The indexer's parameters (the only ones the warm-up stage trains)."""
        return [*self.wq_index.parameters(), *self.wk_index.parameters(), *self.k_index_norm.parameters(),
                *self.w_index.parameters()]

    def _latent_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_b`` split per head into the key up-projection ``[H, nope, C]`` and value ``[H, v, C]``."""
        c = self.config
        w = self.wkv_b.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, mode: str = "sparse") -> tuple[torch.Tensor, torch.Tensor | None]:
        if mode not in MODES:
            raise ValueError(f"DSAttention: mode must be one of {MODES}, got {mode!r}")
        c = self.config
        b, s, _ = x.shape
        h, nope, rope_dim = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        rms_norm, rope = self._rms_norm, self._rope
        cos, sin = rope_tables(s, rope_dim, c.rope_theta, x.device)

        c_q = rms_norm(self.wq_a(x), self.q_norm, c.norm_eps)
        q = self.wq_b(c_q).view(b, s, h, nope + rope_dim)
        q_nope, q_rope = q[..., :nope], rope(q[..., nope:], cos, sin)
        kv_a = self.wkv_a(x)
        c_kv = rms_norm(kv_a[..., : c.kv_lora_rank], self.kv_norm, c.norm_eps)
        k_rope = rope(kv_a[..., None, c.kv_lora_rank :], cos, sin)[:, :, 0]  # one rope key shared by all heads
        w_uk, w_uv = self._latent_weights()

        if mode in ("sparse", "warmup"):
            # absorbed form: q . k = (q_nope W_uk) . c_kv + q_rope . k_rope, one latent KV row per key
            kv_abs = torch.cat([c_kv, k_rope], dim=-1)
            q_idx, k_idx, w_idx = self._indexer_inputs(x, c_q, cos, sin)
        if mode == "sparse":
            indices = self._indexer_topk(q_idx, k_idx, w_idx, c.index_topk)
            # the op absorbs the queries (and un-absorbs the output) itself, a chunk of queries at a time;
            # its log-sum-exp spares the loss's target one of its two passes over the logits
            o, lse = self._sparse_attention(q_nope, q_rope, kv_abs, indices, w_uk, w_uv, c.softmax_scale,
                                            return_lse=True)
            loss = self._sparse_indexer_loss(q_idx, k_idx, w_idx, q_nope, q_rope, w_uk, kv_abs, indices, lse)
        else:
            k_nope = torch.einsum("bsc,hdc->bshd", c_kv, w_uk)
            v = torch.einsum("bsc,hdc->bshd", c_kv, w_uv)
            k = torch.cat([k_nope, k_rope[:, :, None].expand(b, s, h, rope_dim)], dim=-1)
            q_full = torch.cat([q_nope, q_rope], dim=-1)
            o = F.scaled_dot_product_attention(
                q_full.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=c.softmax_scale
            ).transpose(1, 2)
            loss = None
            if mode == "warmup":
                loss = self._indexer_loss(q_idx, k_idx, w_idx, absorb_query(q_nope, q_rope, w_uk).detach(), kv_abs,
                                          c.softmax_scale)
        out = self.wo(o.reshape(b, s, h * c.v_head_dim))
        return out, None if loss is None else loss.mean()

    def _sparse_indexer_loss(self, q_idx, k_idx, w_idx, q_nope, q_rope, w_uk, kv, indices, lse):
        """The sparse stage's indexer loss ``[B, S]``, per chunk of queries: each chunk's absorbed
        queries (the target's, detached) exist only while its loss is computed; ``lse``: the sparse
        attention's log-sum-exp ``[B, S, H]``."""
        c = self.config
        s = q_nope.shape[1]
        chunk = max(1, TARGET_CHUNK_ELEMENTS // (c.num_heads * kv.shape[-1]))
        q_nope, q_rope, w_uk, kv = q_nope.detach(), q_rope.detach(), w_uk.detach(), kv.detach()
        losses = []
        for t0 in range(0, s, chunk):
            t1 = min(t0 + chunk, s)
            q_abs = q_nope.new_empty((*q_nope.shape[:1], t1 - t0, c.num_heads, kv.shape[-1]))
            absorb_query(q_nope[:, t0:t1], q_rope[:, t0:t1], w_uk, out=q_abs)  # (detached: written in place)
            losses.append(self._indexer_loss(q_idx[:, t0:t1], k_idx, w_idx[:, t0:t1], q_abs, kv, c.softmax_scale,
                                             indices[:, t0:t1], lse[:, t0:t1]))
        return torch.cat(losses, dim=1)

    def _indexer_inputs(self, x, c_q, cos, sin):
        """Indexer queries ``[B, S, HI, DI]``, keys ``[B, S, DI]`` and fp32 head weights ``[B, S, HI]``."""
        c = self.config
        b, s, _ = x.shape
        rope = self._rope
        x, c_q = x.detach(), c_q.detach()
        q_idx = rope(self.wq_index(c_q).view(b, s, c.index_n_heads, c.index_head_dim), cos, sin)
        k_idx = rope(self.k_index_norm(self.wk_index(x))[:, :, None], cos, sin)[:, :, 0]
        w_idx = self.w_index(x).float() * (c.index_n_heads ** -0.5 * c.index_head_dim ** -0.5)
        return q_idx, k_idx, w_idx
