"""The Qwen3-MoE family: Qwen3 attention (GQA, per-head q/k RMSNorm) over megatron-core's MoE
layer (softmax top-k router, renormalised top-k probabilities, aux load-balancing loss)."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.recipe_task import make_task
from loongforge.llm.families.moe import build_moe_gpt, layer_spec, load_flavour
from loongforge.llm.families.moe_hf import QWEN3_MOE_HF
from loongforge.llm.moe_config import MoEConfig

QWEN3_MOE_SPEC = ModelSpec(
    name="qwen3_moe",
    config_class=MoEConfig,
    build=build_moe_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen3_moe_debug", "30b-a3b": "qwen3_moe_30b_a3b"},
    layer_spec=layer_spec,
    hf_adapter=QWEN3_MOE_HF,
)


def flavour(name: str) -> MoEConfig:
    return load_flavour(MoEConfig, QWEN3_MOE_SPEC.flavour(name))
