"""The Llama family (Llama 2/3 without RoPE scaling): RMSNorm, RoPE, SwiGLU, GQA on megatron-core."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.recipe_task import make_task
from loongforge.llm.families.gpt import build_gpt, layer_spec, load_flavour
from loongforge.llm.families.gpt_hf import gpt_hf_adapter
from loongforge.llm.model_config import GPTConfig

LLAMA_SPEC = ModelSpec(
    name="llama",
    config_class=GPTConfig,
    build=build_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "llama_debug", "0.5b": "llama_0_5b"},
    layer_spec=layer_spec,
    hf_adapter=gpt_hf_adapter("llama", "LlamaForCausalLM", "LlamaConfig",
                              unsupported={"attention_bias": False, "mlp_bias": False}),
)


def flavour(name: str) -> GPTConfig:
    return load_flavour(LLAMA_SPEC.flavour(name))
