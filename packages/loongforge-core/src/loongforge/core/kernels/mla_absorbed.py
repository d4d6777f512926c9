"""MLA's absorbed form, shared by the torch reference of ``sparse_mla_absorbed_attention``
(loongforge-llm's ``loongforge.llm.ops.dsa``) and its fused kernel (loongforge-kernels'
``sparse_mla_absorbed``): the absorbed query and the check of the op's input shapes."""

from __future__ import annotations

import torch

from loongforge.core.kernels.shapes import check_shapes


def absorb_query(
    q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MLA's absorbed query ``[B, S, H, C + d_rope]``: ``q_nope[b, t, h] @ w_uk[h]`` (into the latent
    space, ``w_uk`` ``[H, d_nope, C]``) next to the rope part.

    ``out``: a contiguous ``[B, S, H, C + d_rope]`` buffer to write into, without autograd (a fused
    op's forward or backward): the GEMM writes the latent columns in place and only the rope part is
    copied, where the differentiable form concatenates (one more pass over the whole result)."""
    if out is None:
        return torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_rope], dim=-1)
    b, s, h, d_nope = q_nope.shape
    c = w_uk.shape[-1]
    per_head = out.view(b * s, h, out.shape[-1]).transpose(0, 1)  # [H, B*S, C + d_rope], rows 16-byte apart
    torch.bmm(q_nope.reshape(b * s, h, d_nope).transpose(0, 1), w_uk, out=per_head[..., :c])
    out[..., c:] = q_rope
    return out


def check_absorbed(op: str, q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                   w_uk: torch.Tensor, w_uv: torch.Tensor) -> dict[str, int]:
    """The dimensions of ``op``'s inputs (``B S H DN DR S_kv D topk C DV``); ValueError naming ``op``
    where a shape disagrees (``kv``'s row is the latent ``C`` and the rope ``DR``)."""
    dims = check_shapes(op, q_nope=(q_nope, "B S H DN"), q_rope=(q_rope, "B S H DR"), kv=(kv, "B S_kv D"),
                        indices=(indices, "B S topk"), w_uk=(w_uk, "H DN C"), w_uv=(w_uv, "H DV C"))
    if dims["C"] + dims["DR"] != dims["D"]:
        raise ValueError(f"{op}: latent {dims['C']} + rope {dims['DR']} != the key row's {dims['D']}")
    return dims
