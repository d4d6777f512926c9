"""The ``loongforge.kernels`` entry point: which fused ops this wheel provides and where they run.

The registry in ``loongforge.core.kernels`` calls :func:`fused_kernels` when it first looks for
fused ops. The ops are those of any package (core's generic ones, loongforge-llm's DSA,
blockwise FP8 and gated delta rule ops, loongforge-diffusion's ``qk_norm_rope``; the gated delta
rule is flash-linear-attention's kernel, ``fla-core``, which loongforge-llm's ``gpu`` extra
installs): this wheel depends on core alone and
names them; the registry refuses an implementation whose op no installed package defines. The op
functions here import their Triton module on first call, so loading the provider on a machine
that never runs them (CPU, a device without Triton) costs nothing, and it imports no package
that defines ops.

The registry chooses by accelerator, once, when a module is built; tensors can still live on the
CPU on a GPU machine (a model built or evaluated on the host). Each op therefore dispatches on its
first input's device: CPU tensors go to the torch reference unless Triton's interpreter is on, as
a torch operator dispatches on its inputs' device.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from loongforge.core.kernels import KernelImpl, get_op
from loongforge.core.kernels.fp8_format import ALL_FP8, Fp8Gemms


def _triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on ``device``: any device but the CPU, and the
    CPU only under Triton's interpreter (fixed when the kernels are imported)."""
    if device.type != "cpu":
        return True
    from loongforge.kernels.launch import INTERPRETED

    return INTERPRETED


def _by_device(op):
    """``op`` for tensors Triton runs on, the registry's torch reference of the same name otherwise
    (looked up when first needed, from the package that defines the op)."""
    name = op.__name__

    @functools.wraps(op)
    def dispatch(first: torch.Tensor, *args, **kwargs):
        if _triton_runs_on(first.device):
            return op(first, *args, **kwargs)
        return get_op(name).reference(first, *args, **kwargs)

    return dispatch


def supports(accelerator) -> bool:
    """Whether the Triton kernels run on ``accelerator``: it must say so, and Triton must be installed."""
    return bool(accelerator.supports_triton()) and importlib.util.find_spec("triton") is not None


@_by_device
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from loongforge.kernels.rms_norm import rms_norm as fused

    return fused(x, weight, eps)


@_by_device
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.rms_norm import add_rms_norm as fused

    return fused(x, residual, weight, eps)


@_by_device
def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.rms_norm import rms_norm_with_residual as fused

    return fused(x, weight, eps)


@_by_device
def embedding_grad_add(table_grad: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor) -> None:
    from loongforge.kernels.embedding_grad import embedding_grad_add as fused

    fused(table_grad, ids, dy)


@_by_device
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from loongforge.kernels.rope import rope as fused

    return fused(x, cos, sin)


@_by_device
def grouped_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from loongforge.kernels.grouped_qkv_rope import grouped_qkv_rope as fused

    return fused(qkv, cos, sin)


@_by_device
def grouped_qkv_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from loongforge.kernels.grouped_qkv_rope import grouped_qkv_norm_rope as fused

    return fused(qkv, cos, sin, q_weight, k_weight, eps)


@_by_device
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    from loongforge.kernels.swiglu import swiglu as fused

    return fused(gate_up)


@_by_device
def swiglu_backward(dy: torch.Tensor, gate_up: torch.Tensor, with_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.swiglu import swiglu_backward as fused

    return fused(dy, gate_up, with_output)


@_by_device
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
    uniform_grad: bool = False,
) -> torch.Tensor:
    from loongforge.kernels.linear_cross_entropy import linear_cross_entropy as fused

    return fused(hidden, weight, labels, ignore_index, uniform_grad=uniform_grad)


@_by_device
def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.sparse_mla import sparse_mla_attention as fused

    return fused(q, kv, indices, softmax_scale, d_v, return_lse)


@_by_device
def sparse_mla_absorbed_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, w_uk: torch.Tensor,
    w_uv: torch.Tensor, softmax_scale: float, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.sparse_mla_absorbed import sparse_mla_absorbed_attention as fused

    return fused(q_nope, q_rope, kv, indices, w_uk, w_uv, softmax_scale, return_lse)


@_by_device
def dsa_indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int) -> torch.Tensor:
    from loongforge.kernels.dsa_indexer import dsa_indexer_topk as fused

    return fused(q_idx, k_idx, w_idx, topk)


@_by_device
def dsa_indexer_loss(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    from loongforge.kernels.dsa_indexer import dsa_indexer_loss as fused

    return fused(q_idx, k_idx, w_idx, q, kv, softmax_scale, indices, lse)


@_by_device
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemms: Fp8Gemms = ALL_FP8
) -> torch.Tensor:
    from loongforge.kernels.fp8_linear import fp8_linear as fused

    return fused(x, weight, bias, gemms)


@_by_device
def fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.fp8_cast import fp8_cast_transpose as fused

    return fused(x, scale, e5m2)


@_by_device
def gelu_tanh_backward(
    dg: torch.Tensor, h: torch.Tensor, with_output: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from loongforge.kernels.gelu import gelu_tanh_backward as fused

    return fused(dg, h, with_output)


@_by_device
def gelu_tanh_backward_in_place(dg: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    from loongforge.kernels.gelu import gelu_tanh_backward_in_place as fused

    return fused(dg, h)


@_by_device
def gelu_fp8_cast_transpose(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from loongforge.kernels.gelu import gelu_fp8_cast_transpose as fused

    return fused(h)


@_by_device
def qk_norm_rope(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.qk_norm_rope import qk_norm_rope as fused

    return fused(qkv, q_weight, k_weight, cos, sin, eps)


@_by_device
def qk_norm_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from loongforge.kernels.qk_norm_rope import qk_norm_rope_backward as fused

    return fused(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps)


@_by_device
def modulated_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, index: torch.Tensor | None = None
) -> torch.Tensor:
    from loongforge.kernels.layer_norm import modulated_layer_norm as fused

    return fused(x, weight, bias, eps, index)


@_by_device
def modulated_layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from loongforge.kernels.layer_norm import modulated_layer_norm_backward as fused

    return fused(dy, x, weight, bias, eps, index)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: torch.Tensor, found_inf: torch.Tensor | None = None,
               plans: dict | None = None) -> None:
    args = (params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf,
            plans)
    if params and _triton_runs_on(params[0].device):  # (a list: dispatched on its first tensor)
        from loongforge.kernels.adamw import adamw_step as fused

        return fused(*args)
    return get_op("adamw_step").reference(*args)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None):
    """flash-linear-attention's chunked ``chunk_gated_delta_rule`` (``fla-core``, which
    loongforge-llm's ``gpu`` extra installs) for CUDA tensors; the reference elsewhere (fla's
    kernels are CUDA-only, also under Triton's interpreter)."""
    reference = get_op("gated_delta_rule").reference
    if q.device.type != "cuda":
        return reference(q, k, v, g, beta, cu_seqlens, initial_state)
    if importlib.util.find_spec("fla") is None:
        raise RuntimeError("gated_delta_rule on CUDA needs fla-core (flash-linear-attention's kernels): "
                           "pip install 'loongforge-llm[gpu]'")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if v.shape[2] % q.shape[2]:
        raise ValueError(f"gated_delta_rule: {v.shape[2]} value heads are not a multiple of {q.shape[2]} key heads")
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # each q/k head serves rep consecutive value heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return chunk_gated_delta_rule(q, k, v, g.float(), beta, initial_state=initial_state, output_final_state=True,
                                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
                                  use_qk_l2norm_in_kernel=True)


def supports_fp8(accelerator) -> bool:
    """Where Triton runs, except CUDA GPUs older than compute capability 8.9 (no FP8 tensor cores)."""
    if not supports(accelerator):
        return False
    if accelerator.device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return True


_OPS = (
    rms_norm, add_rms_norm, rms_norm_with_residual, embedding_grad_add, rope, grouped_qkv_rope, grouped_qkv_norm_rope, swiglu, swiglu_backward, linear_cross_entropy, sparse_mla_attention,
    sparse_mla_absorbed_attention, dsa_indexer_topk, dsa_indexer_loss,
    gelu_tanh_backward, gelu_tanh_backward_in_place, qk_norm_rope, qk_norm_rope_backward, modulated_layer_norm, modulated_layer_norm_backward,
    adamw_step, gated_delta_rule,
)
_FP8_OPS = (fp8_linear, fp8_cast_transpose, gelu_fp8_cast_transpose)


def fused_kernels() -> dict[str, KernelImpl]:
    """``{op_name: KernelImpl}`` for every op of this wheel (the entry-point provider)."""
    ops = {fn.__name__: KernelImpl(fn=fn, supports=supports) for fn in _OPS}
    ops.update({fn.__name__: KernelImpl(fn=fn, supports=supports_fp8) for fn in _FP8_OPS})
    return ops
