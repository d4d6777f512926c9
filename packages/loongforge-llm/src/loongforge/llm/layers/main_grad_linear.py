"""megatron's parallel linears whose weight-gradient GEMM adds straight into megatron DDP's
gradient buffer (``weight.main_grad``), without Apex.

megatron fuses that accumulation only through Apex's ``fused_weight_gradient_mlp_cuda``; without it
every linear's weight gradient is a new tensor that megatron's DDP hook then adds to ``main_grad``
(one more pass over every weight's gradient, plus the allocation). Here, on a tensor-parallel
group of one (and for row-parallel linears at any TP size), the local GEMM is ``MainGradLinear``: its backward computes ``dgrad`` and
``main_grad += dy.T @ x`` as one GEMM that adds in place (in ``main_grad``'s dtype: bf16 under pure
bf16, fp32 in mixed precision, where the GEMM's fp32 result is added without a bf16 rounding first),
and hands autograd an unfilled placeholder with ``weight.grad_added_to_main_grad`` set, as megatron's
own fused path does, so the DDP hook skips its add: inside the megatron engine's schedule
(``loongforge.core.training.main_grad``), where gradients are read from ``main_grad``. Outside it
(``torch.autograd.grad`` of a loss, a probe), outside megatron DDP (no ``main_grad``), with a
frozen weight, or where megatron fuses communication into the GEMM (a column-parallel linear's
dgrad all-reduce under tensor parallelism, sequence parallelism) megatron's own path runs.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from loongforge.core.kernels.matmul import add_matmul
from loongforge.core.training.main_grad import main_grad_fusion_active
from loongforge.llm.layers.discarded_output import TakesDiscardedInput


class MainGradLinear(torch.autograd.Function):
    """``y = x @ weight.T (+ bias)``; the weight's gradient goes into ``weight.main_grad``.
    ``discarded``: the ``DiscardedOutput`` ``x`` came from, which hands ``x`` back, recomputed, to
    the backward (nothing of ``x`` is saved here)."""

    @staticmethod
    def forward(ctx, x, weight, bias, discarded=None):
        ctx.discarded = discarded
        if discarded is None:
            ctx.save_for_backward(x)
        # the parameter itself (not a saved copy: saved-tensor hooks such as activation offloading hand
        # back new tensors, without main_grad)
        ctx.weight = weight
        ctx.has_bias = bias is not None
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):
        weight = ctx.weight
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.matmul(dy, weight) if need_x else None
        # the input gradient first: a DiscardedOutput with a fused backward recomputes x from it
        x = ctx.discarded.recomputed_input(dx) if ctx.discarded is not None else ctx.saved_tensors[0]
        ctx.discarded = None
        dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if need_w:
            add_matmul(weight.main_grad, dy2.t(), x.reshape(-1, x.shape[-1]))
            weight.grad_added_to_main_grad = True
            # a placeholder, so that autograd runs the DDP hook (which skips its add): megatron's convention
            dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        if need_b and ctx.has_bias:
            db = dy2.sum(0)
        return dx, dw, db, None


class _MainGradGemm(TakesDiscardedInput):
    """The local GEMM (``_forward_impl``) of megatron's parallel linears on ``MainGradLinear`` where
    it applies (see the module docstring), megatron's own otherwise; an input offered by a
    ``DiscardedOutput`` is taken over there (not saved)."""

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, gtp_remat_size=1):
        discarded, self.discarded_input = self.discarded_input, None
        own = (  # no communication fused into the GEMM (megatron overlaps a TP dgrad all-reduce with it)
            main_grad_fusion_active()
            and hasattr(weight, "main_grad")
            and weight.requires_grad
            and hasattr(weight, "grad_added_to_main_grad")
            and not allreduce_dgrad
            and not sequence_parallel
            and grad_output_buffer is None
            and gtp_remat_size == 1
        )
        if not own:
            return super()._forward_impl(input=input, weight=weight, bias=bias,
                                         gradient_accumulation_fusion=gradient_accumulation_fusion,
                                         allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                         grad_output_buffer=grad_output_buffer,
                                         wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group,
                                         gtp_remat_size=gtp_remat_size)
        if discarded is not None and not discarded.claim(input):
            discarded = None
        return MainGradLinear.apply(input, weight, bias, discarded)


class MainGradColumnParallelLinear(_MainGradGemm, ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` whose weight gradient adds into ``main_grad`` in its GEMM."""


class MainGradRowParallelLinear(_MainGradGemm, RowParallelLinear):
    """megatron's ``RowParallelLinear`` whose weight gradient adds into ``main_grad`` in its GEMM."""
