"""The DeepSeek-V3 family: multi-latent attention, the first layers dense, then MoE layers with
a shared expert and sigmoid, group-limited routing with an aux-loss-free balancing bias
(megatron-core's MLA and MoE layers). DeepSeek-V3.2 is the same family with DeepSeek sparse
attention (``attention_variant: dsa``; flavours ``v3.2-debug``, ``v3.2-671b``). Multi-token
prediction is not built."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.recipe_task import make_task
from loongforge.llm.families.moe import build_moe_gpt, layer_spec, load_flavour
from loongforge.llm.families.moe_hf import DEEPSEEK_V3_HF
from loongforge.llm.moe_config import MLAMoEConfig

DEEPSEEK_V3_SPEC = ModelSpec(
    name="deepseek_v3",
    config_class=MLAMoEConfig,
    build=build_moe_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "deepseek_v3_debug", "671b": "deepseek_v3_671b",
              "v3.2-debug": "deepseek_v3_2_debug", "v3.2-671b": "deepseek_v3_2_671b"},
    layer_spec=layer_spec,
    hf_adapter=DEEPSEEK_V3_HF,
)


def flavour(name: str) -> MLAMoEConfig:
    return load_flavour(MLAMoEConfig, DEEPSEEK_V3_SPEC.flavour(name))
