"""The attention input of megatron's grouped QKV projection, split and rotated in one op.

megatron's ``linear_qkv`` writes, per query group, the group's query heads, then its key head, then
its value head: viewed as ``qkv [S, B, G, P + 2, D]`` (``G`` groups of ``P`` query heads of
``D`` dims). ``grouped_qkv_rope(qkv, cos, sin)`` returns what attention reads:

    query [S, B, G * P, D]   the query heads, rotated
    key   [S, B, G, D]       the key heads, rotated
    value [S, B, G, D]       the value heads, as they are

each contiguous, rotated by RoPE in the rotate-half (Llama/NeoX) convention with one ``cos`` /
``sin`` row per token (``[S, B, rot]``, fp32; dims past ``rot`` pass through). This torch
composition is the op's contract (a ``loongforge.ops`` entry point of loongforge-llm). The fused
version in ``loongforge-kernels`` reads each token's ``qkv`` row once and writes the three outputs;
its backward writes the gradient of the whole ``qkv`` row in one pass, where autograd through the
views builds a zero-filled gradient per slice and adds them up.

``grouped_qkv_norm_rope(qkv, cos, sin, q_weight, k_weight, eps)`` is the same with each query and
key head RMS-normalised over its ``D`` dims first (Qwen3's q/k norms: one ``[D]`` weight for every
query head, one for every key head), each normalised head rounded to ``qkv``'s dtype before it is
rotated, as the separate norm and RoPE ops do. Its fused version does the norms in the same pass
(and their backward, with the weights' gradients, in the backward's), where the separate ops take
a copy of the strided query and key heads, a norm and a rotation each way.
"""

from __future__ import annotations

import torch

from loongforge.core.kernels.reference import rms_norm, rope
from loongforge.core.kernels.shapes import check_shapes


def grouped_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, key, value)`` of ``qkv`` (see the module docstring)."""
    sizes = check_shapes("grouped_qkv_rope", qkv=(qkv, "S B G P2 D"), cos=(cos, "S B R"), sin=(sin, "S B R"))
    s, b, groups, d = sizes["S"], sizes["B"], sizes["G"], sizes["D"]
    per_group = sizes["P2"] - 2
    c, sn = cos[:, :, None], sin[:, :, None]  # one row per token, for every group
    query = rope(qkv[..., :per_group, :], c, sn).reshape(s, b, groups * per_group, d)
    key = rope(qkv[..., per_group : per_group + 1, :], c, sn).reshape(s, b, groups, d)
    value = qkv[..., per_group + 1, :].contiguous()
    return query, key, value


def grouped_qkv_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, key, value)`` of ``qkv`` with the query and key heads RMS-normalised (``q_weight`` /
    ``k_weight``, ``[D]``) before the rotation (see the module docstring)."""
    sizes = check_shapes("grouped_qkv_norm_rope", qkv=(qkv, "S B G P2 D"), cos=(cos, "S B R"), sin=(sin, "S B R"),
                         q_weight=(q_weight, "D"), k_weight=(k_weight, "D"))
    s, b, groups, d = sizes["S"], sizes["B"], sizes["G"], sizes["D"]
    per_group = sizes["P2"] - 2
    c, sn = cos[:, :, None], sin[:, :, None]
    query = rope(rms_norm(qkv[..., :per_group, :], q_weight, eps), c, sn).reshape(s, b, groups * per_group, d)
    key = rope(rms_norm(qkv[..., per_group : per_group + 1, :], k_weight, eps), c, sn).reshape(s, b, groups, d)
    value = qkv[..., per_group + 1, :].contiguous()
    return query, key, value
