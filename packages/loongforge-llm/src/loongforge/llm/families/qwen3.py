"""The Qwen3 dense family: the Llama layout plus per-head q/k RMSNorm and an explicit head dim
(``model.kv_channels``, 128 for every size: not ``hidden_size / heads``)."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.recipe_task import make_task
from loongforge.llm.families.gpt import build_gpt, layer_spec, load_flavour
from loongforge.llm.families.gpt_hf import gpt_hf_adapter
from loongforge.llm.model_config import GPTConfig

QWEN3_SPEC = ModelSpec(
    name="qwen3",
    config_class=GPTConfig,
    build=build_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen3_debug", "0.6b": "qwen3_0_6b"},
    layer_spec=layer_spec,
    hf_adapter=gpt_hf_adapter("qwen3", "Qwen3ForCausalLM", "Qwen3Config", qk_layernorm=True,
                              unsupported={"attention_bias": False, "use_sliding_window": False}),
)


def flavour(name: str) -> GPTConfig:
    return load_flavour(QWEN3_SPEC.flavour(name))
