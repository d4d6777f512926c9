"""The layer spec of the Transformer-Engine-free path (``families.gpt.layer_spec`` picks it).

It keeps megatron's local spec's modules for the linears (tensor parallel as megatron does it),
its parameter names and its sharded-state-dict key map, so checkpoints and the HF mapping are the
same whichever spec trained them. Inside an ``fp8_linear.fp8_linears(mode)`` block the linears are
their blockwise-FP8 subclasses (the same parameters and state dict).
"""

from __future__ import annotations

import dataclasses
import functools

from loongforge.core.kernels import KernelPolicy


def _local_spec(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")


def _with_attention(spec, module, kernels: KernelPolicy, **submodules):
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, module=module, params={**attention.params, "kernels": kernels},
                                    submodules=dataclasses.replace(attention.submodules, **submodules))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def _fp8_linear_classes(mode: str, kernels: KernelPolicy) -> tuple:
    """The column- and row-parallel linear builders of FP8 ``mode`` (blockwise | adaptive)."""
    from loongforge.llm.layers.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    adaptive = mode == "adaptive"
    return (functools.partial(Fp8ColumnParallelLinear, adaptive=adaptive, kernels=kernels),
            functools.partial(Fp8RowParallelLinear, adaptive=adaptive, kernels=kernels))


def fast_layer_spec(cfg, recompute_elementwise: bool = True, kernels: KernelPolicy = KernelPolicy()):
    """The fast decoder layer: ``FusedTransformerLayer`` (fused residual add + RMSNorm, no no-op
    dropout, norm/SwiGLU outputs recomputed in the backward when ``recompute_elementwise``),
    ``FusedSelfAttention`` (fused RoPE read from the qkv projection) on ``SDPAttention``,
    ``FusedRMSNorm`` norms (also q/k norms) and ``FusedMLP`` (fused SwiGLU), each op from the
    ``loongforge.core.kernels`` registry, resolved by ``kernels`` when the modules are built. QKV,
    the attention output and MLP fc1/fc2 are ``main_grad_linear``'s linears (their weight gradient
    added into megatron DDP's buffer by the GEMM itself), or, in an ``fp8_linears`` block of mode
    blockwise or adaptive, FP8 linears."""
    from loongforge.llm.layers.attention import SDPAttention
    from loongforge.llm.layers.fp8_linear import active_fp8_mode
    from loongforge.llm.layers.mlp import FusedMLP
    from loongforge.llm.layers.norm import FusedRMSNorm
    from loongforge.llm.layers.self_attention import FusedSelfAttention
    from loongforge.llm.layers.transformer_layer import FusedTransformerLayer

    spec = _local_spec(cfg)
    norm = functools.partial(FusedRMSNorm, kernels=kernels)
    qk_norm = {"q_layernorm": norm, "k_layernorm": norm} if cfg.qk_layernorm else {}
    fp8 = active_fp8_mode()
    if fp8 != "none":
        column, row = _fp8_linear_classes(fp8, kernels)
    else:
        from loongforge.llm.layers.main_grad_linear import MainGradColumnParallelLinear, MainGradRowParallelLinear

        column, row = MainGradColumnParallelLinear, MainGradRowParallelLinear
    attention_linears = {"linear_qkv": column, "linear_proj": row}
    mlp_linears = {"linear_fc1": column, "linear_fc2": row}
    spec = _with_attention(spec, FusedSelfAttention, kernels, core_attention=SDPAttention, **qk_norm,
                           **attention_linears)
    mlp = spec.submodules.mlp
    if not isinstance(mlp, functools.partial):
        raise TypeError(f"fast_layer_spec: megatron's local MLP spec is {mlp!r}; expected MLP.as_mlp_submodule")
    mlp_submodules = dataclasses.replace(mlp.keywords["submodules"], **mlp_linears)
    mlp = functools.partial(FusedMLP.as_mlp_submodule, *mlp.args,
                            **{**mlp.keywords, "submodules": mlp_submodules, "kernels": kernels})
    submodules = dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, mlp=mlp)
    return dataclasses.replace(spec, module=FusedTransformerLayer, submodules=submodules,
                               params={**spec.params, "recompute_elementwise": recompute_elementwise})
