"""adaLN's LayerNorm as one autograd function, ``normalize_and_modulate``, over the registry's
``modulated_layer_norm`` ops (``layer_norm.py`` holds their contracts): ``layer_norm(x) * weight
+ bias`` with ``weight``/``bias`` shared by every token or looked up per sample, one pass forward
and one backward."""

from __future__ import annotations

import torch

from loongforge.core.kernels.registry import OpWithBackward


class _ModulatedLayerNorm(torch.autograd.Function):
    """Saves ``x``, the transform and the index; the backward recomputes each row's statistics
    in its one pass."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, index, kernels: OpWithBackward):
        ctx.save_for_backward(x, weight, bias, index)
        ctx.eps, ctx.kernels = eps, kernels
        return kernels.forward(x, weight, bias, eps, index)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, index = ctx.saved_tensors
        dx, dweight, dbias = ctx.kernels.backward(dy, x, weight, bias, ctx.eps, index)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        return (dx if need_x else None, dweight.to(weight.dtype) if need_w else None,
                dbias.to(bias.dtype) if need_b else None, None, None, None)


def normalize_and_modulate(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, kernels: OpWithBackward,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``layer_norm(x) * weight[index] + bias[index]`` over the last dim of ``x`` ``[tokens, width]``,
    in fp32, rounded to ``x``'s dtype; ``weight``/``bias`` ``[1, width]`` shared by every token
    (``index`` None) or ``[samples, width]`` with ``index`` the sample of each token.
    ``kernels``: ``get_kernel_with_backward("modulated_layer_norm")``, resolved once by the caller."""
    return _ModulatedLayerNorm.apply(x, weight, bias, eps, index, kernels)
