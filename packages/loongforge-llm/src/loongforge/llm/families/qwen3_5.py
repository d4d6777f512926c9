"""The Qwen3.5 dense family (Hugging Face ``Qwen3_5ForCausalLM``, ``model_type: qwen3_5_text``):
gated full attention every ``full_attention_interval``-th layer, Gated DeltaNet in the others,
SwiGLU MLPs (``qwen3_5_config``, ``qwen3_5_layers``, ``qwen3_5_hf``)."""

from __future__ import annotations

import torch

from loongforge.core.models import ModelSpec
from loongforge.llm.families.qwen3_5_hf import QWEN3_5_HF
from loongforge.llm.qwen3_5_config import Qwen35Config
from loongforge.llm.recipe_task import make_task


def build_qwen3_5(cfg: Qwen35Config, ctx, transformer_config, pre_process: bool, post_process: bool) -> torch.nn.Module:
    from loongforge.llm.families.gpt import gpt_model_kwargs
    from loongforge.llm.families.qwen3_5_layers import dense_block
    from loongforge.llm.layers.gpt_model import FusedLossGPTModel

    spec = dense_block(cfg, transformer_config, ctx.kernels)
    return FusedLossGPTModel(**gpt_model_kwargs(cfg, ctx, transformer_config, spec, pre_process, post_process),
                             kernels=ctx.kernels)


QWEN3_5_SPEC = ModelSpec(
    name="qwen3_5",
    config_class=Qwen35Config,
    build=build_qwen3_5,
    engine="megatron",
    task=make_task,
    flavours={"debug": "qwen3_5_debug"},
    hf_adapter=QWEN3_5_HF,
)


def flavour(name: str) -> Qwen35Config:
    from loongforge.core.config import load_config
    from loongforge.llm.shipped_configs import MODEL_CONFIG_DIR

    return load_config(Qwen35Config, QWEN3_5_SPEC.flavour(name), config_dirs=[MODEL_CONFIG_DIR])
