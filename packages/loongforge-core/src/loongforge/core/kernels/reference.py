"""Torch references of core's generic transformer ops: ``rms_norm``, ``add_rms_norm``,
``rms_norm_with_residual``, ``embedding_grad_add``, ``rope``,
``swiglu`` (and ``swiglu_backward``), ``linear_cross_entropy``.

Each defines its op's contract (shapes, dtypes, numerics) and is registered under the op's name
as a ``loongforge.ops`` entry point in core's ``pyproject.toml``, like core's other generic ops
(the tensor-wise FP8 cast in ``fp8_tensorwise.py``, the feed-forward's GELU ops in ``gelu.py``,
adaLN's LayerNorm in ``layer_norm.py``); model-specific ops are defined by the packages that own
them. Fused versions registered through the ``loongforge.kernels`` entry-point group must match
them; they are what runs when no fused version applies (CPU, a device without Triton, or a
forced reference). An op ``<name>_backward`` is the backward of ``<name>``
(``get_kernel_with_backward`` resolves both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32, cast back."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns ``(rms_norm(x + residual), x + residual)``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm that also passes its input on as the residual stream: ``(rms_norm(x), x)`` (a decoder
    layer's input norm). The gradients of both outputs reach ``x``; a fused version adds them in the
    norm's own backward pass, where autograd would add them in a pass of its own."""
    return rms_norm(x, weight, eps), x


def embedding_grad_add(table_grad: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor) -> None:
    """An embedding lookup's gradient added into ``table_grad`` (``[vocab, hidden]``, e.g. a
    gradient buffer), in place: ``table_grad[ids[t]] += dy[t]`` for every token ``t`` (``dy``:
    ``[*ids.shape, hidden]``), each row's tokens summed in fp32 and added with one rounding; rows
    no token looked up are left as they are. ``ids`` must lie in ``[0, vocab)``. (This reference
    sums through a dense fp32 table, with ``index_add_``: on CUDA its order, and so its last bits,
    may vary; loongforge-kernels' version is deterministic.)"""
    sums = torch.zeros(table_grad.shape, dtype=torch.float32, device=table_grad.device)
    sums.index_add_(0, ids.reshape(-1), dy.reshape(-1, table_grad.shape[-1]).float())
    touched = torch.zeros(table_grad.shape[0], dtype=torch.bool, device=table_grad.device)
    touched[ids.reshape(-1)] = True
    table_grad[touched] = (table_grad[touched].float() + sums[touched]).to(table_grad.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half (Llama/NeoX) convention.

    ``x``: ``[*tokens, heads, head_dim]``; ``cos``/``sin``: ``[*tokens, rot_dim]`` (broadcastable
    to ``x.shape[:-2]``), ``rot_dim <= head_dim`` even; dims past ``rot_dim`` pass through.
    Packed (THD) inputs pass per-token cos/sin gathered at each token's position in its sequence.
    """
    rot = cos.shape[-1]
    c = cos.unsqueeze(-2).float()
    s = sin.unsqueeze(-2).float()
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (xr * c + rotated * s).to(x.dtype)
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = cat([gate, up], -1)`` (megatron's fc1 layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(dy: torch.Tensor, gate_up: torch.Tensor, with_output: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu``'s backward: ``(d(gate_up), swiglu(gate_up))`` from the output's gradient ``dy``,
    ``d(gate_up)`` in ``gate_up``'s concatenated layout and dtype; the output (recomputed, for a
    layer that did not keep it) only ``with_output``, else an empty tensor. Computed in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d = dy.float()
    dgate_up = torch.cat([d * up * sig * (1 + gate * (1 - sig)), d * silu], dim=-1).to(gate_up.dtype)
    return dgate_up, (silu * up).to(gate_up.dtype) if with_output else gate_up.new_empty(0)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    uniform_grad: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` against ``labels``, in fp32.

    ``hidden``: ``[N, H]``, ``weight``: ``[V, H]``, ``labels``: ``[N]``; returns ``[N]`` fp32 losses
    with 0 at ``ignore_index``. Fused versions never materialise the full ``[N, V]`` fp32 logits.
    ``uniform_grad``: the caller's promise that every counted token's loss gets the same gradient
    (a sum or mean of the losses over the counted tokens), which lets a fused version's backward
    run without reading anything back; a gradient that breaks it may give a NaN weight gradient
    there (never a wrong finite one). This reference's gradient is exact for any.
    """
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")

