"""The Qwen2.5 family: the Llama layout plus q/k/v projection biases, often tied embeddings."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.recipe_task import make_task
from loongforge.llm.families.gpt import build_gpt, layer_spec, load_flavour
from loongforge.llm.families.gpt_hf import gpt_hf_adapter
from loongforge.llm.model_config import GPTConfig

QWEN2_SPEC = ModelSpec(
    name="qwen2",
    config_class=GPTConfig,
    build=build_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen2_debug", "0.5b": "qwen2_5_0_5b"},
    layer_spec=layer_spec,
    hf_adapter=gpt_hf_adapter("qwen2", "Qwen2ForCausalLM", "Qwen2Config", add_qkv_bias=True,
                              unsupported={"use_sliding_window": False}),
)


def flavour(name: str) -> GPTConfig:
    return load_flavour(QWEN2_SPEC.flavour(name))
