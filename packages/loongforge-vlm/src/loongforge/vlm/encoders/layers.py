"""megatron-core pieces of the vision encoders: their TransformerConfig and layer specs.

A ViT layer is megatron's ``TransformerLayer`` (column/row-parallel linears, so the encoder is
tensor-parallel in whatever TP group it is given) with ``SegmentAttention`` as core attention.
The block's spec lists one layer spec per layer, so window- and full-attention layers differ
only in which segmentation their core attention reads.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loongforge.core.training.megatron_engine import recompute_kwargs
from loongforge.vlm.encoders.attention import FULL, WINDOW, SegmentAttention
from loongforge.vlm.model_config import EncoderConfig

# Settings of the foundation's TransformerConfig that every part of one model shares.
SHARED_RUNTIME_FIELDS = ("params_dtype", "bf16", "fp16", "use_cpu_initialization", "perform_initialization",
                         "pipeline_dtype", "deterministic_mode")

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}

_FUSIONS_OFF = dict(bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                    bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)


def shared_runtime(foundation_config) -> dict:
    return {name: getattr(foundation_config, name) for name in SHARED_RUNTIME_FIELDS
            if hasattr(foundation_config, name)}


def encoder_transformer_config(cfg: EncoderConfig, tp: int, recompute: str, foundation_config):
    """The encoder's own TransformerConfig: its architecture, its TP size and recompute, and the
    dtype/initialisation settings of the foundation's config."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.gated_mlp,
        activation_func=ACTIVATIONS[cfg.activation],
        add_bias_linear=True,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **_FUSIONS_OFF,
        **recompute_kwargs(recompute),
        **shared_runtime(foundation_config),
    )


def projector_transformer_config(hidden_in: int, ffn_hidden_size: int, hidden_out: int, tp: int, init_std: float,
                                 foundation_config):
    """A TransformerConfig describing the projector's MLP (fc1: hidden_in -> ffn, fc2: ffn -> hidden_out)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden_out,
        num_attention_heads=tp,  # unused by an MLP; megatron wants a multiple of the TP size
        ffn_hidden_size=ffn_hidden_size,
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        hidden_dropout=0.0,
        init_method_std=init_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **_FUSIONS_OFF,
        **shared_runtime(foundation_config),
    )


def vit_layer_spec(segment_row: int, cfg: EncoderConfig | None = None):
    """One ViT layer: pre-norm self-attention within segments (``segment_row``) and an MLP;
    norm type, gating and activation come from the encoder's TransformerConfig. The encoder's
    config may add layer scale on both branches (``layer_scale``) and a query/key RMSNorm over
    all heads together (``qk_norm``)."""
    import dataclasses
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from loongforge.vlm.encoders.aligned_linear import AlignedRowParallelLinear

    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=False, for_qk=False, has_residual=True)  # follows config.normalization
    # both output linears pad their input width for the GEMMs (Qwen2.5-VL's MLP: 3,420 wide)
    out_linear: Any = AlignedRowParallelLinear
    if cfg is not None and cfg.layer_scale:
        from loongforge.vlm.encoders.layer_scale import LayerScaledRowParallelLinear

        out_linear = partial(LayerScaledRowParallelLinear, layer_scale_init=cfg.layer_scale_init)
    mlp = get_mlp_module_spec_for_backend(backend=backend)
    mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": dataclasses.replace(
        mlp.keywords["submodules"], linear_fc2=out_linear)})
    qk_norm = None
    if cfg is not None and cfg.qk_norm:
        from loongforge.vlm.encoders.qk_norm import WholeWidthRMSNorm

        qk_norm = WholeWidthRMSNorm
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=ModuleSpec(module=SegmentAttention, params={"segment_row": segment_row}),
                    linear_proj=out_linear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # checkpoint names of the fused-norm (Transformer Engine) layout, as megatron's GPT specs use
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def vit_block_spec(cfg: EncoderConfig):
    """The encoder block: each layer attends over whole frames or within windows, as the
    encoder's config says (``full_attention``)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    specs = [vit_layer_spec(FULL if cfg.full_attention(i) else WINDOW, cfg) for i in range(cfg.num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LocalSpecProvider().layer_norm())


def init_linear_(layer: torch.nn.Linear, std: float) -> None:
    """The initialisation megatron gives its linears (normal weights, zero bias)."""
    torch.nn.init.normal_(layer.weight, mean=0.0, std=std)
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def with_dtype(config, module: torch.nn.Module) -> torch.nn.Module:
    return module.to(dtype=config.params_dtype)

