"""Building megatron-core GPT models (Llama-style: RMSNorm, RoPE, SwiGLU, GQA) from a GPTConfig."""

from __future__ import annotations

import torch

from loongforge.core.config import load_config
from loongforge.core.kernels import KernelPolicy
from loongforge.llm.model_config import GPTConfig
from loongforge.llm.shipped_configs import MODEL_CONFIG_DIR


def load_flavour(name: str) -> GPTConfig:
    """A model config shipped in ``configs/model/<name>.yaml``."""
    return load_config(GPTConfig, name, config_dirs=[MODEL_CONFIG_DIR])


def layer_spec(cfg: GPTConfig, recompute_elementwise: bool | None = None, kernels: KernelPolicy = KernelPolicy()):
    """The megatron ModuleSpec of one decoder layer: Transformer Engine's when it is installed,
    else LoongForge's fast layer (SDPA attention and the fused ops of ``loongforge.core.kernels``,
    resolved by ``kernels``). ``recompute_elementwise`` (an option of the fast layer alone):
    given, the fast layer with that setting even where Transformer Engine is installed."""
    import importlib.util

    from loongforge.llm.layers.spec import fast_layer_spec

    if recompute_elementwise is not None:
        return fast_layer_spec(cfg, recompute_elementwise=recompute_elementwise, kernels=kernels)
    if importlib.util.find_spec("transformer_engine") is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    return fast_layer_spec(cfg, kernels=kernels)


def gpt_model_kwargs(cfg, ctx, transformer_config, layer_spec, pre_process: bool, post_process: bool) -> dict:
    """The arguments megatron's ``GPTModel`` (and ``FusedLossGPTModel``) takes for a decoder-only family
    with RoPE, after checking the vocabulary splits over tensor parallelism."""
    if cfg.vocab_size % ctx.layout.tp:
        raise ValueError(f"model.vocab_size={cfg.vocab_size} must be divisible by parallel.tp={ctx.layout.tp}")
    return dict(config=transformer_config, transformer_layer_spec=layer_spec, vocab_size=cfg.vocab_size,
                max_sequence_length=cfg.max_position_embeddings, pre_process=pre_process, post_process=post_process,
                share_embeddings_and_output_weights=cfg.tie_embeddings, position_embedding_type="rope",
                rotary_percent=cfg.rotary_percent, rotary_base=int(cfg.rotary_base), pg_collection=ctx.pgs)


def build_gpt(cfg: GPTConfig, ctx, transformer_config, pre_process: bool, post_process: bool,
              recompute_elementwise: bool | None = None) -> torch.nn.Module:
    """This rank's GPT model, its registry ops resolved by ``ctx.kernels``; ``recompute_elementwise``:
    see ``layer_spec``."""
    from loongforge.llm.layers.gpt_model import FusedLossGPTModel

    spec = layer_spec(cfg, recompute_elementwise, ctx.kernels)
    return FusedLossGPTModel(**gpt_model_kwargs(cfg, ctx, transformer_config, spec, pre_process, post_process),
                             kernels=ctx.kernels)
