"""The Mistral family (Mistral 7B v0.3, Mistral Nemo...): the Llama layout (RMSNorm, RoPE, SwiGLU,
GQA, untied embeddings) with its own Hugging Face architecture, refused when the checkpoint uses
sliding-window attention (Mistral 7B v0.1/v0.2: ``sliding_window: 4096``)."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.llm.families.gpt import build_gpt, layer_spec, load_flavour
from loongforge.llm.families.gpt_hf import gpt_hf_adapter
from loongforge.llm.model_config import GPTConfig
from loongforge.llm.recipe_task import make_task

MISTRAL_SPEC = ModelSpec(
    name="mistral",
    config_class=GPTConfig,
    build=build_gpt,
    engine="megatron",
    task=make_task,
    flavours={"debug": "mistral_debug", "7b": "mistral_7b"},
    layer_spec=layer_spec,
    hf_adapter=gpt_hf_adapter("mistral", "MistralForCausalLM", "MistralConfig",
                              unsupported={"sliding_window": None, "attention_dropout": 0.0}),
)


def flavour(name: str) -> GPTConfig:
    return load_flavour(MISTRAL_SPEC.flavour(name))
