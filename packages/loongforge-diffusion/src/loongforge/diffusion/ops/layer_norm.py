"""LayerNorm with an affine transform per sample, as a DiT's adaLN uses it: the registry
contracts (torch references); ``modulated_norm.normalize_and_modulate`` is the autograd function
that calls them.

``modulated_layer_norm(x, weight, bias, eps, index)`` is ``layer_norm(x) * weight[i] + bias[i]``
for each token (row) of ``x`` (``[tokens, width]``), ``i = index[token]``, with the statistics, the
transform and its parameters in fp32 and the result rounded to ``x``'s dtype. ``weight``/``bias``
are ``[rows, width]`` tables: one row shared by every token (``index`` None: a LayerNorm's own
affine parameters, or the adaLN modulation ``1 + scale``/``shift`` of a pack of one sample), or
one row per sample of a pack with ``index`` the sample of each token (int64 ``[tokens]``, values
below ``rows``). Its backward gives ``dx`` in ``x``'s dtype and the fp32 gradients of ``weight`` and
``bias`` (``[rows, width]``, each row summed over its tokens).

A fused version reads ``x`` once forward and ``x`` with the output gradient once backward, and
looks the transform up per token instead of materialising it, where autograd of the composed
ops makes several passes and a compiler fuses the per-token reductions with the over-tokens sums
of the parameter gradients less well.
"""

from __future__ import annotations

import torch


def check_layer_norm(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     index: torch.Tensor | None) -> tuple[int, int]:
    """``(tokens, width)`` of valid inputs; a clear error naming the bad one otherwise."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [tokens, width], got shape {tuple(x.shape)}")
    tokens, width = x.shape
    if weight.dim() != 2 or weight.shape[1] != width or bias.shape != weight.shape:
        raise ValueError(f"{op}: weight and bias must both be [rows, {width}], got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if index is None and weight.shape[0] != 1:
        raise ValueError(f"{op}: a transform of {weight.shape[0]} rows needs an index (the row of each token)")
    if index is not None and (index.shape != (tokens,) or index.dtype != torch.int64):
        raise ValueError(f"{op}: index must be int64 [tokens={tokens}], got {index.dtype} {tuple(index.shape)}")
    return tokens, width


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``((x - mean) * rstd, rstd)`` per row (biased variance, as ``layer_norm``)."""
    xf = x.float()
    centered = xf - xf.mean(1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(1, keepdim=True) + eps)
    return centered * rstd, rstd


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t.float() if index is None else t.float()[index]


def modulated_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, index: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer_norm(x) * weight[index] + bias[index]`` in fp32, rounded to ``x``'s dtype. Always a
    new tensor (``copy=True``: an autograd function's output that aliases a tensor made in its
    forward, here the input of a ``.to`` that changes nothing, loses its gradient in compiled
    graphs, torch 2.11)."""
    check_layer_norm("modulated_layer_norm", x, weight, bias, index)
    return (_normalized(x, eps)[0] * _rows(weight, index) + _rows(bias, index)).to(x.dtype, copy=True)


def modulated_layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` from the output gradient ``dy`` ``[tokens, width]``; ``bias`` is
    read for its shape only."""
    check_layer_norm("modulated_layer_norm_backward", x, weight, bias, index)
    dyf = dy.float()
    xhat, rstd = _normalized(x, eps)
    g = dyf * _rows(weight, index)
    dx = rstd * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    if index is None:
        return dx.to(x.dtype), (dyf * xhat).sum(0, keepdim=True), dyf.sum(0, keepdim=True)
    sums = [torch.zeros(weight.shape, dtype=torch.float32, device=x.device).index_add_(0, index, t) for t in (dyf * xhat, dyf)]
    return dx.to(x.dtype), sums[0], sums[1]
