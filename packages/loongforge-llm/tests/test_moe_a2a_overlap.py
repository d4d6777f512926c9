"""MoE all-to-all overlap (``model.moe_a2a_overlap``, megatron-core's combined 1F1B schedule): on
two processes with EP=2 (gloo, bf16), every micro-batch runs through the model's schedule plan,
and the losses, grad norms and first-step gradients equal the same run without overlap; what it
does not run with is refused before any process group."""

import pytest
from llm_grad_probe import assert_same_training, probe

from loongforge.core.config import ConfigError
from loongforge.llm.recipe import load_llm_config

EP2 = ["train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=64", "train.precision=bf16",
       "parallel.ep=2"]


@pytest.mark.slow
def test_overlapped_ep2_equals_not_overlapped(tmp_path_factory):
    root = tmp_path_factory.mktemp("a2a")
    cache = root / "llm-data"
    want = probe(root / "plain" / "grads.pt", "train_qwen3_moe_debug", EP2, cache, nproc=2)
    got = probe(root / "overlap" / "grads.pt", "train_qwen3_moe_debug", [*EP2, "model.moe_a2a_overlap=true"],
                cache, nproc=2)
    assert want["schedule_plans"] == 0
    assert got["schedule_plans"] == 4  # 2 micro-batches a step on each rank, 2 steps: all through the plan
    assert_same_training(got, want)


@pytest.mark.parametrize("overrides, message", [
    ([], "needs parallel.ep > 1"),
    (["parallel.ep=2", "train.precision=fp32"], "train.precision=fp32"),
    (["parallel.ep=2", "train.recompute=full"], "train.recompute=full"),
    (["parallel.ep=2", "recipe=sft"], "model.moe_a2a_overlap=true with recipe=sft"),
])
def test_overlap_refuses_what_megatron_cannot_overlap(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace(".", r"\.").replace("+", r"\+")):
        load_llm_config("train_qwen3_moe_debug", ["model.moe_a2a_overlap=true", *overrides])
