"""The Qwen3.5 MoE family (Hugging Face ``Qwen3_5MoeForCausalLM``): the Qwen3.5 hybrid layers
(Gated DeltaNet, gated full attention every ``full_attention_interval``-th layer) over megatron-core's
MoE layer in every layer (softmax top-k router with renormalised probabilities, one shared expert
scaled by a sigmoid gate, the aux load-balancing loss)."""

from __future__ import annotations

import torch

from loongforge.core.models import ModelSpec
from loongforge.llm.families.qwen3_5_hf import QWEN3_5_MOE_HF
from loongforge.llm.qwen3_5_config import Qwen35MoEConfig
from loongforge.llm.recipe_task import make_task


def build_qwen3_5_moe(cfg: Qwen35MoEConfig, ctx, transformer_config, pre_process: bool, post_process: bool
                      ) -> torch.nn.Module:
    from loongforge.llm.families.moe import build_moe_gpt
    from loongforge.llm.families.qwen3_5_layers import moe_block

    return build_moe_gpt(cfg, ctx, transformer_config, pre_process, post_process, layers=moe_block)


QWEN3_5_MOE_SPEC = ModelSpec(
    name="qwen3_5_moe",
    config_class=Qwen35MoEConfig,
    build=build_qwen3_5_moe,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen3_5_moe_debug"},
    hf_adapter=QWEN3_5_MOE_HF,
)
