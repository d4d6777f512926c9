"""Tanh-GELU ops of a feed-forward's hidden layer: the registry contracts (torch references).

A feed-forward ``down(gelu(up(x)))`` over many tokens spends its elementwise time on the hidden
activation ``h = up(x)`` (``[tokens, ffn_dim]``, the largest activation of a DiT block). The fused
versions of these ops (``loongforge-kernels``) read it once per use at full bandwidth:

- ``gelu_tanh_backward(dg, h, with_output)``: the GELU's backward from the gradient of its output
  and its saved input, together with what a feed-forward's backward also needs from the same pass:
  the up-projection's bias gradient (``dh`` summed over tokens, fp32), ``amax(|dh|)`` (an FP8
  cast's scale) and, on request, the recomputed output ``gelu(h)`` (the down-projection's weight
  gradient reads it);
- ``gelu_tanh_backward_in_place(dg, h)``: the same backward written over ``dg`` (no ``[M, N]``
  tensor beside it), returning the bias gradient: what a feed-forward in the autocast dtype needs;
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


IN_PLACE_BLOCKS = 8  # the row blocks of the in-place backward's reference


@torch.library.custom_op("loongforge_diffusion::gelu_tanh_backward_in_place", mutates_args=("dg",))
def gelu_tanh_backward_in_place(dg: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Overwrites ``dg`` (the gradient of ``gelu(h)``, ``[M, N]``) with ``dh``, the GELU's backward in
    ``dg``'s dtype, and returns the bias gradient ``dh.sum(0)`` (fp32, summed over the fp32 ``dh``).
    In row blocks (``IN_PLACE_BLOCKS`` of them), so that its fp32 temporaries are one block's: an
    eighth of ``dg`` where it is bf16, as in place as the fused op on the devices without it. A
    custom op, as the fused one is, so that compiled graphs run it as it is, in place on ``dg``
    (traced, inductor would not write ``dh`` over ``dg``)."""
    check_matrices("gelu_tanh_backward_in_place", dg, h)
    rows = -(-dg.shape[0] // IN_PLACE_BLOCKS)
    db = dg.new_zeros(dg.shape[1], dtype=torch.float32)
    for start in range(0, dg.shape[0], rows):
        dg_rows = dg[start : start + rows]
        dh32 = torch.ops.aten.gelu_backward(dg_rows.float(), h[start : start + rows].float(), approximate="tanh")
        dg_rows.copy_(dh32)
        db += dh32.sum(0)
    return db


@gelu_tanh_backward_in_place.register_fake
def _(dg: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return dg.new_empty(dg.shape[1], dtype=torch.float32)


def gelu_fp8_cast_transpose(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, N], q_t [N, M'], scale)``: ``gelu(h)`` (fp32, not rounded to ``h``'s dtype) cast to
    e4m3 with the tensor-wise scale ``amax(|gelu(h)|) / 448`` in both layouts (``cast_transpose``)."""
    check_matrices("gelu_fp8_cast_transpose", h)
    g = F.gelu(h.float(), approximate="tanh")
    scale = tensor_scale(g, E4M3)
    return *cast_transpose(g, scale, False), scale
