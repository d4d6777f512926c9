"""Tanh-GELU ops of a feed-forward's hidden layer: the registry contracts (torch references).

A feed-forward ``down(gelu(up(x)))`` over many tokens spends its elementwise time on the hidden
activation ``h = up(x)`` (``[tokens, ffn_dim]``, the largest activation of a DiT block). The fused
versions of these ops (``loongforge-kernels``) read it once per use at full bandwidth:

- ``gelu_tanh_backward(dg, h, with_output)``: the GELU's backward from the gradient of its output
  and its saved input, together with what a feed-forward's backward also needs from the same pass:
  the up-projection's bias gradient (``dh`` summed over tokens, fp32), ``amax(|dh|)`` (an FP8
  cast's scale) and, on request, the recomputed output ``gelu(h)`` (the down-projection's weight
  gradient reads it);
- ``gelu_fp8_cast_transpose(h)``: ``gelu(h)`` quantised to e4m3 in both layouts Hopper's FP8
  GEMMs read, with its tensor-wise scale (``amax(|gelu(h)|) / 448``), without writing ``gelu(h)``
  itself.

GELU is diffusers'/PyTorch's tanh approximation ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``,
computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge.core.kernels.fp8_format import E4M3, tensor_scale
from loongforge.core.kernels.shapes import check_matrices
from loongforge.diffusion.ops.fp8_tensorwise import cast_transpose


def gelu_tanh_backward(
    dg: torch.Tensor, h: torch.Tensor, with_output: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g = gelu(h)``'s backward over ``[M, N]`` matrices: ``(dh, dh.sum(0), amax(|dh|), g)``.

    ``dh`` has ``dg``'s dtype; the column sum (the bias gradient of the linear that made ``h``)
    and the amax are fp32, summed and taken over the fp32 ``dh`` before it is rounded; ``g`` is
    ``gelu(h)`` in ``h``'s dtype when ``with_output``, else an empty tensor.
    """
    check_matrices("gelu_tanh_backward", dg, h)
    dh32 = torch.ops.aten.gelu_backward(dg.float(), h.float(), approximate="tanh")
    g = F.gelu(h.float(), approximate="tanh").to(h.dtype) if with_output else h.new_empty(0)
    return dh32.to(dg.dtype), dh32.sum(0), dh32.abs().amax(), g


def gelu_fp8_cast_transpose(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, N], q_t [N, M'], scale)``: ``gelu(h)`` (fp32, not rounded to ``h``'s dtype) cast to
    e4m3 with the tensor-wise scale ``amax(|gelu(h)|) / 448`` in both layouts (``cast_transpose``)."""
    check_matrices("gelu_fp8_cast_transpose", h)
    g = F.gelu(h.float(), approximate="tanh")
    scale = tensor_scale(g, E4M3)
    return *cast_transpose(g, scale, False), scale
