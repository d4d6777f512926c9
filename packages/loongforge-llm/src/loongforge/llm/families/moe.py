"""Building megatron-core mixture-of-experts GPT models (Qwen3-MoE, DeepSeek-V3/V3.2) from a MoEConfig.

Layers come from megatron's own decoder block spec, so the dense/MoE pattern
(``first_k_dense``), multi-latent attention and the MoE layer (router, ``SequentialMLP``
experts, shared experts, alltoall token dispatch over the EP group) are megatron-core's
modules; nothing here re-implements them. The experts use the local backend's
``SequentialMLP`` (no Transformer Engine grouped GEMM), which runs anywhere megatron-core does.
Two local-backend gaps are filled in the specs: the norms (``norm.RMSNorm``, usable under
sequence parallelism, which megatron's MoE layer needs with TP) and the core attention, the fast
path's SDPA one (``layers.attention.SDPAttention``; for MLA ``core_attention.LatentSDPAttention``,
different query/key and value head dims) instead of the local backend's, which materialises the
scores.
DeepSeek-V3.2's sparse attention (``attention_variant: dsa``) takes its layers from megatron's
DSA specs instead (``dsa``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TypeVar

import torch

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.moe_config import MLAMoEConfig, MoEConfig

C = TypeVar("C", bound=MoEConfig)


def _local_layer(layer, cfg: MoEConfig, kernels: KernelPolicy = KernelPolicy()):
    """``layer`` (a local-backend TransformerLayer spec) with our RMSNorm in place of megatron's
    torch norm wrapper (see ``norm``) and the fast path's SDPA core attention in place of megatron's
    local one (which materialises the ``[b, heads, s, s]`` scores); for MLA, the SDPA attention
    taking MLA's head dims."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from loongforge.llm.families.core_attention import LatentSDPAttention
    from loongforge.llm.families.norm import RMSNorm
    from loongforge.llm.layers.attention import SDPAttention

    def norms(submodules):
        changes = {f.name: RMSNorm for f in dataclasses.fields(submodules) if getattr(submodules, f.name) is WrappedTorchNorm}
        return dataclasses.replace(submodules, **changes)

    attention = layer.submodules.self_attention
    attention_sub = norms(attention.submodules)
    attention_sub = dataclasses.replace(
        attention_sub, core_attention=LatentSDPAttention if isinstance(cfg, MLAMoEConfig) else SDPAttention)
    attention = dataclasses.replace(attention, submodules=attention_sub)
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(norms(layer.submodules), self_attention=attention))
    return _with_fp8_linears(layer, kernels)


# megatron's MLA accepts only its own classes for the low-rank down projections (it sets their
# gather_output by class): they stay bf16, the up projections and the output projection go FP8
MLA_DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


def _with_fp8_linears(spec, kernels: KernelPolicy):
    """Inside an ``fp8_linears`` block (``fp8=blockwise|adaptive``), every column- and row-parallel
    linear of the layer spec (attention projections, MLA's up projections, a dense MLP, the shared
    experts and each routed expert's fc1/fc2) as an FP8 linear; the router and MLA's down
    projections stay as they are."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge.llm.layers.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear, active_fp8_mode

    mode = active_fp8_mode()
    if mode == "none":
        return spec
    params = {"adaptive": mode == "adaptive", "kernels": kernels}  # megatron builds ModuleSpecs, not partials
    swap = {ColumnParallelLinear: ModuleSpec(module=Fp8ColumnParallelLinear, params=params),
            RowParallelLinear: ModuleSpec(module=Fp8RowParallelLinear, params=params)}

    def rewrite(node):
        if isinstance(node, type) and node in swap:
            return swap[node]
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, submodules=rewrite(node.submodules))
        if isinstance(node, functools.partial):  # e.g. MLP.as_mlp_submodule(submodules=...)
            return functools.partial(node.func, *node.args, **{k: rewrite(v) for k, v in node.keywords.items()})
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(node, **{f.name: rewrite(getattr(node, f.name)) for f in dataclasses.fields(node)
                                                if f.name not in MLA_DOWN_PROJECTIONS})
        return node

    return rewrite(spec)


def layer_spec(cfg: MoEConfig):
    """The megatron ModuleSpec of one MoE decoder layer (local backend)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if isinstance(cfg, MLAMoEConfig) and cfg.dsa:
        from megatron.core.transformer import TransformerConfig

        from loongforge.llm.families import dsa

        return dsa.layer_specs(model_transformer_config(cfg, TransformerConfig(**cfg.transformer_config_kwargs())))[-1]

    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
                                    multi_latent_attention=isinstance(cfg, MLAMoEConfig), normalization="RMSNorm")
    return _local_layer(spec, cfg)


def block_spec(cfg: MoEConfig, config, kernels: KernelPolicy = KernelPolicy()):
    """This pipeline stage's layer specs: dense and MoE layers by ``config.moe_layer_freq``;
    ``kernels``: the policy of DSA attention's registry ops."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from loongforge.llm.families.norm import RMSNorm

    if isinstance(cfg, MLAMoEConfig) and cfg.dsa:
        from loongforge.llm.families import dsa

        return dsa.block_spec(config, kernels)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    final_norm = RMSNorm if block.layer_norm is WrappedTorchNorm else block.layer_norm
    return dataclasses.replace(block, layer_specs=[_local_layer(s, cfg, kernels) for s in block.layer_specs], layer_norm=final_norm)


def model_transformer_config(cfg: MoEConfig, transformer_config):
    """The config the layers are built with.

    megatron's MoE layer refuses to train under tensor parallelism without sequence
    parallelism, so with TP > 1 the run's config switches it on (before the model and its DDP
    wrapper exist: the embedding then scatters the sequence, the output layer gathers it and
    finalize_model_grads all-reduces the norm and router gradients over TP). Multi-latent
    attention needs megatron's ``MLATransformerConfig``, a subclass carrying the MLA fields;
    the run's config is copied into one.
    """
    if transformer_config.tensor_model_parallel_size > 1:
        transformer_config.sequence_parallel = True
    if not isinstance(cfg, MLAMoEConfig):
        return transformer_config
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    values = {f.name: getattr(transformer_config, f.name) for f in dataclasses.fields(transformer_config) if f.init}
    values.update(cfg.mla_config_kwargs())
    return MLATransformerConfig(**values)


def build_moe_gpt(cfg: MoEConfig, ctx, transformer_config, pre_process: bool, post_process: bool,
                  layers=None) -> torch.nn.Module:
    """megatron's GPTModel over MoE layers: ``layers(cfg, config, kernels)`` gives the block spec
    (``block_spec``, this module's uniform MoE block, unless a family brings its own)."""
    from megatron.core.models.gpt import GPTModel

    from loongforge.llm.families.gpt import gpt_model_kwargs

    ep = ctx.layout.ep
    if cfg.num_experts % ep:
        raise ValueError(f"model.num_experts={cfg.num_experts} must be divisible by parallel.ep={ep}")
    config = model_transformer_config(cfg, transformer_config)
    spec = (layers or block_spec)(cfg, config, ctx.kernels)
    return GPTModel(**gpt_model_kwargs(cfg, ctx, config, spec, pre_process, post_process))


def load_flavour(config_class: type[C], name: str) -> C:
    """A model config shipped in ``configs/model/<name>.yaml``, validated as ``config_class``."""
    from loongforge.core.config import load_config
    from loongforge.llm.families.gpt import MODEL_CONFIG_DIR

    return load_config(config_class, name, config_dirs=[MODEL_CONFIG_DIR])
