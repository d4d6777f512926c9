"""The inputs of Wan-style self-attention from a fused QKV projection: queries and keys
RMS-normalised and rotated by the registry's ``qk_norm_rope`` ops (``qk_norm_rope.py`` holds
their contracts), values a view of the projection's output, with one backward pass that writes
the projection's whole gradient."""

from __future__ import annotations

import torch

from loongforge.core.kernels import OpWithBackward


class _QKNormRope(torch.autograd.Function):
    """Saves ``qkv`` only; the backward recomputes each row's norm statistic in its one pass."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, eps: float, kernels: OpWithBackward):
        q, k = kernels.forward(qkv, q_weight, k_weight, cos, sin, eps)
        ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.kernels = eps, kernels
        return q, k, qkv[:, 2 * q.shape[1] :]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dqkv, dweights = ctx.kernels.backward(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, ctx.eps)
        need_w = ctx.needs_input_grad[1:3]
        return (dqkv, dweights[0].to(q_weight.dtype) if need_w[0] else None,
                dweights[1].to(k_weight.dtype) if need_w[1] else None, None, None, None, None)


def normed_rotated_qkv(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    eps: float, kernels: OpWithBackward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` ``[tokens, width]`` each for attention from a fused QKV projection's output:
    queries and keys RMS-normalised (``q_weight``/``k_weight``) and rotated, values a view of
    ``qkv``. ``kernels``: ``get_kernel_with_backward("qk_norm_rope")``, resolved once by the caller."""
    return _QKNormRope.apply(qkv, q_weight, k_weight, cos, sin, eps, kernels)
