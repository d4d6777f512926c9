"""The Qwen3.5 MoE family (Hugging Face ``Qwen3_5MoeForCausalLM``): the Qwen3.5 hybrid layers
(Gated DeltaNet, gated full attention every ``full_attention_interval``-th layer) over megatron-core's
MoE layer in every layer (softmax top-k router with renormalised probabilities, one shared expert
scaled by a sigmoid gate, the aux load-balancing loss)."""

from __future__ import annotations

import torch

from loongforge.core.models import ModelSpec
from loongforge.llm.families.qwen3_5_hf import QWEN3_5_MOE_HF
from loongforge.llm.qwen3_5_config import Qwen35MoEConfig
from loongforge.llm.recipe import make_task


def build_qwen3_5_moe(cfg: Qwen35MoEConfig, ctx, transformer_config, pre_process: bool, post_process: bool
                      ) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    from loongforge.llm.families.moe import model_transformer_config
    from loongforge.llm.families.qwen3_5_layers import moe_block

    if cfg.vocab_size % ctx.layout.tp:
        raise ValueError(f"model.vocab_size={cfg.vocab_size} must be divisible by parallel.tp={ctx.layout.tp}")
    if cfg.num_experts % ctx.layout.ep:
        raise ValueError(f"model.num_experts={cfg.num_experts} must be divisible by parallel.ep={ctx.layout.ep}")
    config = model_transformer_config(cfg, transformer_config)
    return GPTModel(
        config=config,
        transformer_layer_spec=moe_block(cfg, config, ctx.kernels),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=cfg.rotary_percent,
        rotary_base=int(cfg.rotary_base),
        pg_collection=ctx.pgs,
    )


QWEN3_5_MOE_SPEC = ModelSpec(
    name="qwen3_5_moe",
    config_class=Qwen35MoEConfig,
    build=build_qwen3_5_moe,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen3_5_moe_debug"},
    hf_adapter=QWEN3_5_MOE_HF,
)
