"""megatron's tensor-parallel linears with their GEMMs in blockwise FP8 (the recipe's ``fp8`` key).

``Fp8ColumnParallelLinear`` and ``Fp8RowParallelLinear`` are megatron's ``ColumnParallelLinear``
and ``RowParallelLinear`` -- same parameters, initialisation, sharded state dict and
tensor-parallel communication -- whose local GEMM (the ``_forward_impl`` both forwards call) is
the registry's ``fp8_linear``: the input, the weight and the output gradient are quantised
blockwise to e4m3 in the forward and in both backward GEMMs, and the master weight stays in the
param dtype (see ``loongforge.llm.ops.fp8_blockwise``, the op's contract). On CUDA GPUs of compute capability 8.9+ that
op is the fused kernel of ``loongforge-kernels``; elsewhere the torch reference, which emulates
the FP8 numerics in fp32. Each linear hands the op its ``fp8_gemms`` (core's ``Fp8Gemms``: which
of fprop, dgrad and wgrad run in FP8; the others run in the input's dtype).

The modes are ``none`` (megatron's linears), ``blockwise`` (every GEMM in FP8) and ``adaptive``
(``adaptive=True``: a linear's GEMMs are the run's ``FP8Plan`` choice for its weight shape, which
the task hands it after the build with :func:`apply_fp8_plan`; one that was never given a choice
refuses to run). A family's builder makes its layer spec itself, so the mode reaches
``fast_layer_spec`` through an ``fp8_linears(mode)`` block around the build
(``LLMTask.build_model`` opens it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from loongforge.core.kernels import KernelPolicy
from loongforge.core.kernels.fp8_format import ALL_FP8, Fp8Gemms
from loongforge.llm.layers.fp8_plan import FP8Plan, label

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

FP8_MODES = ("none", "blockwise", "adaptive")

_MODE: ContextVar[str] = ContextVar("loongforge_llm_fp8_mode", default="none")


def check_fp8_mode(mode: str, key: str = "fp8") -> str:
    """``mode`` if it is one of :data:`FP8_MODES`, else a ``ValueError`` naming ``key``."""
    if mode not in FP8_MODES:
        raise ValueError(f"{key}={mode!r}: one of {', '.join(FP8_MODES)}")
    return mode


@contextmanager
def fp8_linears(mode: str) -> Iterator[None]:
    """Layer specs made by ``fast_layer_spec`` inside this block use FP8 linears of ``mode``."""
    token = _MODE.set(check_fp8_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def active_fp8_mode() -> str:
    """The mode of the innermost ``fp8_linears`` block (``none`` outside any)."""
    return _MODE.get()


class _Fp8Gemm(torch.nn.Module):
    """The local GEMM of megatron's parallel linears on the registry's ``fp8_linear``.

    megatron's ``forward`` prepares the input and reduces the output; its ``_forward_impl`` runs
    the GEMM with the communication megatron fuses into it: with sequence parallelism the input
    is all-gathered over the sequence (its gradient reduce-scattered), and a column-parallel
    input's gradient is all-reduced over TP (``allreduce_dgrad``). Here the same communication
    runs through megatron's autograd mappings around the FP8 GEMM. The weight gradient is
    returned as ``.grad``, which megatron's DDP adds to ``main_grad`` (so no gradient
    accumulation fusion).
    """

    # set by the megatron linear this is mixed into (the FP8 linears always allocate their weight)
    config: TransformerConfig
    weight: torch.nn.Parameter
    gtp_remat_size: int

    def __init__(self, *args, adaptive: bool = False, kernels: KernelPolicy = KernelPolicy(), **kwargs):
        super().__init__(*args, **kwargs)
        if self.gtp_remat_size > 1:
            raise ValueError(f"{type(self).__name__}: GTP weight sharding (gtp_remat_size={self.gtp_remat_size}) "
                             "is not supported with FP8 linears")
        if self.config.defer_embedding_wgrad_compute:
            raise ValueError(f"{type(self).__name__}: deferred weight-gradient GEMMs "
                             "(defer_embedding_wgrad_compute) are not supported with FP8 linears")
        self.fp8_adaptive = adaptive
        # adaptive: None until the run's plan is applied (apply_fp8_plan)
        self.fp8_gemms: Fp8Gemms | None = None if adaptive else ALL_FP8
        self._fp8_linear = kernels.get("fp8_linear")

    def fp8_shape(self) -> tuple[int, int]:
        """The local weight's ``(out_features, in_features)``: the key of this linear in an ``FP8Plan``."""
        out_features, in_features = self.weight.shape
        return int(out_features), int(in_features)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, gtp_remat_size=1):
        # see the class doc and __init__ (which refuses GTP and deferred weight gradients)
        del gradient_accumulation_fusion, grad_output_buffer, wgrad_deferral_limit, gtp_remat_size
        if self.fp8_gemms is None:
            raise RuntimeError(f"{type(self).__name__} (fp8=adaptive, weight {'x'.join(map(str, self.fp8_shape()))}) "
                               "has no FP8 plan: the task that builds it applies the run's FP8Plan (apply_fp8_plan)")
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return self._fp8_linear(input, weight, bias, gemms=self.fp8_gemms)

    def extra_repr(self) -> str:
        if not self.fp8_adaptive:
            return f"{super().extra_repr()}, fp8=blockwise"
        chosen = "no plan" if self.fp8_gemms is None else label(self.fp8_gemms)
        return f"{super().extra_repr()}, fp8=adaptive ({chosen} in FP8)"


class Fp8ColumnParallelLinear(_Fp8Gemm, ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` (output dim split over TP) with a blockwise FP8 GEMM."""


class Fp8RowParallelLinear(_Fp8Gemm, RowParallelLinear):
    """megatron's ``RowParallelLinear`` (input dim split over TP) with a blockwise FP8 GEMM."""


def count_fp8_linears(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules are FP8 linears."""
    return sum(isinstance(m, _Fp8Gemm) for m in model.modules())


def adaptive_fp8_linears(model: torch.nn.Module) -> list[_Fp8Gemm]:
    """``model``'s FP8 linears built with ``adaptive=True``."""
    return [m for m in model.modules() if isinstance(m, _Fp8Gemm) and m.fp8_adaptive]


def adaptive_fp8_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The sorted local weight shapes of ``model``'s adaptive FP8 linears (the shapes a plan needs)."""
    return sorted({m.fp8_shape() for m in adaptive_fp8_linears(model)})


def apply_fp8_plan(model: torch.nn.Module, plan: FP8Plan) -> int:
    """Hands each adaptive FP8 linear of ``model`` ``plan``'s choice for its weight shape; returns
    how many it set. A shape the plan lacks is a ``LookupError`` naming it."""
    linears = adaptive_fp8_linears(model)
    for m in linears:
        m.fp8_gemms = plan.gemms(*m.fp8_shape())
    return len(linears)
