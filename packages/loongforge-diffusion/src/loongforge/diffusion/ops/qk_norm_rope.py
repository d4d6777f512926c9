"""Query/key RMSNorm and rotary embedding of a fused QKV projection, as Wan's self-attention does
them: the contracts of the registry ops ``qk_norm_rope`` and ``qk_norm_rope_backward`` (torch
references, defined by loongforge-diffusion); ``attention_inputs.normed_rotated_qkv`` is the
autograd function that calls them.

Wan normalises queries and keys with an RMSNorm across all heads (``norm_q``/``norm_k`` over the
model width) and rotates channel pairs ``(2i, 2i+1)`` of each head (diffusers' interleaved RoPE,
the complex product ``(a + ib)(cos + i sin)``). Left to autograd, or to inductor, the two ops
and their backward make several passes over queries and keys and a separate copy to put the
three gradients back into the QKV projection's layout. Here:

- ``qk_norm_rope(qkv, q_weight, k_weight, cos, sin, eps)`` reads the query and key columns of
  ``qkv`` (``[tokens, 3 * width]``, the projection's output) once and writes the rotated queries
  and keys (``[tokens, width]`` each, in ``qkv``'s dtype; values stay a view of ``qkv``);
- ``qk_norm_rope_backward(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps)`` reads the
  attention's three gradients and ``qkv`` once and writes the projection's gradient
  ``[tokens, 3 * width]`` whole, with both norm weights' gradients (``[2, width]``, fp32).

``cos``/``sin``: ``[tokens, head_dim / 2]`` fp32, the angle of each channel pair of a head at
each token (packed batches pass one row per token). Numerics are those of the two ops composed
in autograd: the norm in fp32, its output rounded to ``qkv``'s dtype before the rotation (in
fp32), and the rotation's gradient rounded to it before the norm's backward.
"""

from __future__ import annotations

import torch


def check_qkv(op: str, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int]:
    """``(tokens, width)`` of valid inputs; a clear error naming the bad one otherwise."""
    if qkv.dim() != 2 or qkv.shape[1] % 3:
        raise ValueError(f"{op}: qkv must be [tokens, 3 * width], got shape {tuple(qkv.shape)}")
    tokens, width = qkv.shape[0], qkv.shape[1] // 3
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (width,):
            raise ValueError(f"{op}: {name} must be [{width}] (the width of qkv {tuple(qkv.shape)}), got {tuple(w.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != tokens:
        raise ValueError(f"{op}: cos and sin must both be [tokens={tokens}, head_dim / 2], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    pairs = cos.shape[1]
    if pairs == 0 or width % (2 * pairs):
        raise ValueError(f"{op}: head_dim 2 * {pairs} (from cos {tuple(cos.shape)}) does not divide the width {width}")
    return tokens, width


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool, dtype: torch.dtype) -> torch.Tensor:
    """fp32 rows ``y`` with their channel pairs rotated by their angle (``transpose``: by minus
    the angle), rounded to ``dtype``. Always a new tensor (``copy=True``: an autograd function's
    output that aliases a tensor made in its forward, here a view of the stacked halves, loses
    its gradient in compiled graphs, torch 2.11)."""
    a, b = y.unflatten(1, (-1, cos.shape[1], 2)).unbind(-1)  # [tokens, heads, pairs]
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    if transpose:
        c_a, c_b = a * c + b * s, b * c - a * s
    else:
        c_a, c_b = a * c - b * s, a * s + b * c
    return torch.stack((c_a, c_b), dim=-1).flatten(1).to(dtype, copy=True)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps)


def qk_norm_rope(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(rms_norm(q)), rope(rms_norm(k)))`` of the query and key columns of ``qkv``."""
    _, width = check_qkv("qk_norm_rope", qkv, q_weight, k_weight, cos, sin)
    out = []
    for i, weight in enumerate((q_weight, k_weight)):
        x = qkv[:, i * width : (i + 1) * width].float()
        y = (x * _rstd(x, eps) * weight.float()).to(qkv.dtype)
        out.append(_rotate(y.float(), cos, sin, False, qkv.dtype))
    return out[0], out[1]


def qk_norm_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d qkv [tokens, 3 * width] in dq's dtype, [d q_weight, d k_weight] fp32 [2, width])`` from the
    gradients of the rotated queries and keys and of the values (each ``[tokens, width]``, or
    ``[tokens, heads, head_dim]``)."""
    tokens, width = check_qkv("qk_norm_rope_backward", qkv, q_weight, k_weight, cos, sin)
    grads, dweights = [], []
    for i, (d_out, weight) in enumerate(((dq, q_weight), (dk, k_weight))):
        dy = _rotate(d_out.reshape(tokens, width).float(), cos, sin, True, qkv.dtype).float()
        x = qkv[:, i * width : (i + 1) * width].float()
        rstd = _rstd(x, eps)
        xhat = x * rstd
        g = dy * weight.float()
        grads.append((rstd * (g - xhat * (g * xhat).mean(1, keepdim=True))).to(dq.dtype))
        dweights.append((dy * xhat).sum(0))
    grads.append(dv.reshape(tokens, width).to(dq.dtype))
    return torch.cat(grads, dim=1), torch.stack(dweights)
