"""LayerNorm with a per-token or shared affine transform, as a DiT's adaLN uses it: the registry
contracts (torch references); ``modulated_norm.normalize_and_modulate`` is the autograd function
that calls them.

``modulated_layer_norm(x, weight, bias, eps)`` is ``layer_norm(x) * weight + bias`` over the last
dim of ``x`` (``[tokens, width]``), with the statistics, the transform and its parameters in fp32
and the result rounded to ``x``'s dtype. ``weight``/``bias`` are ``[1, width]`` (one transform for
every token: a LayerNorm's own affine parameters, or the adaLN modulation ``1 + scale``/``shift``
of a pack of one sample) or ``[tokens, width]`` (a modulation gathered per token from each
token's sample). Its backward gives ``dx`` in ``x``'s dtype and the fp32 gradients of ``weight`` and
``bias`` in their shapes: summed over tokens when shared, per token otherwise.

A fused version reads ``x`` once forward and ``x`` with the output gradient once backward, where
autograd of the composed ops makes several passes and a compiler fuses the per-token reductions
with the over-tokens sums of the parameter gradients less well.
"""

from __future__ import annotations

import torch


def check_layer_norm(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[int, int]:
    """``(tokens, width)`` of valid inputs; a clear error naming the bad one otherwise."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [tokens, width], got shape {tuple(x.shape)}")
    tokens, width = x.shape
    for name, t in (("weight", weight), ("bias", bias)):
        if t.dim() != 2 or t.shape[1] != width or t.shape[0] not in (1, tokens):
            raise ValueError(f"{op}: {name} must be [1, {width}] or [tokens={tokens}, {width}], got {tuple(t.shape)}")
    if weight.shape[0] != bias.shape[0]:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must both be shared or both per token")
    return tokens, width


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``((x - mean) * rstd, rstd)`` per row (biased variance, as ``layer_norm``)."""
    xf = x.float()
    centered = xf - xf.mean(1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(1, keepdim=True) + eps)
    return centered * rstd, rstd


def modulated_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``layer_norm(x) * weight + bias`` in fp32, rounded to ``x``'s dtype. Always a new tensor
    (``copy=True``: an autograd function's output that aliases a tensor made in its forward, here
    the input of a ``.to`` that changes nothing, loses its gradient in compiled graphs, torch 2.11)."""
    check_layer_norm("modulated_layer_norm", x, weight, bias)
    return (_normalized(x, eps)[0] * weight.float() + bias.float()).to(x.dtype, copy=True)


def modulated_layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` from the output gradient ``dy`` ``[tokens, width]``; ``bias`` is
    read for its shape only."""
    check_layer_norm("modulated_layer_norm_backward", x, weight, bias)
    dyf = dy.float()
    xhat, rstd = _normalized(x, eps)
    g = dyf * weight.float()
    dx = rstd * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    dweight, dbias = dyf * xhat, dyf
    if weight.shape[0] == 1:  # shared: summed over tokens
        dweight, dbias = dweight.sum(0, keepdim=True), dbias.sum(0, keepdim=True)
    return dx.to(x.dtype), dweight, dbias
