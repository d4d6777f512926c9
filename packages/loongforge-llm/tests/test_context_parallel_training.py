"""parallel.cp=2 (two processes, gloo, fp32) trains like one process: the same losses and, after
the first step, the same gradient of every parameter (``tests/llm_grad_probe.py``), for pre-training rows and
for packed SFT rows of conversations of uneven lengths."""

import pytest
from llm_grad_probe import PRETRAIN, assert_same_training, probe

# 8 conversations a step, packed into rows of up to 256 positions (several conversations each)
SFT = ["train.global_batch_size=8", "train.seq_length=256"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-data")


@pytest.mark.slow
@pytest.mark.long  # (the default tier's budget: tests/test_llm_parallel.py trains pretraining at CP=2 against one process)
def test_pretraining_cp2_matches_one_process(tmp_path, data_cache):
    want = probe(tmp_path / "cp1" / "grads.pt", "train_debug", PRETRAIN, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", "train_debug", [*PRETRAIN, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)
    b, s = want["first_tokens_shape"]
    assert got["first_tokens_shape"] == (b, s // 2)  # each CP rank holds half of every row


@pytest.mark.slow
# padded rows: left out of CI's default run (its time budget); packed SFT splits the same way per segment
@pytest.mark.parametrize("packing", [True, pytest.param(False, marks=pytest.mark.long)], ids=["packed", "padded-rows"])
def test_sft_cp2_matches_one_process(packing, tmp_path, data_cache):
    """Conversations of uneven lengths: packed, each padded to a multiple of 2*cp and split per
    segment; unpacked, rows padded to a multiple of 2*cp (the pads train nothing either way)."""
    sft = [*SFT, f"sft.packing={str(packing).lower()}"]
    want = probe(tmp_path / "cp1" / "grads.pt", "sft_debug", sft, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", "sft_debug", [*sft, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)
    (b, s), (b2, s2) = want["first_tokens_shape"], got["first_tokens_shape"]
    assert b2 == b and s // 2 <= s2 < s  # half the padded row: the conversations were split


@pytest.mark.slow
# Qwen3-MoE's attention is the dense families' SDPA core (test_pretraining_cp2_matches_one_process): -m long
# both under -m long (CI's time budget): MLA under CP=2 runs in CI through the packed SFT case below
@pytest.mark.parametrize("config", [pytest.param("train_deepseek_v3_debug", marks=pytest.mark.long),
                                    pytest.param("train_qwen3_moe_debug", marks=pytest.mark.long)],
                         ids=["mla", "qwen3-moe"])
def test_moe_families_pretraining_cp2_matches_one_process(config, tmp_path, data_cache):
    """DeepSeek-V3's multi-latent attention (megatron's MLA with LatentSDPAttention) and Qwen3-MoE's
    attention: megatron slices the RoPE angles per CP rank, the core attention gathers K/V."""
    want = probe(tmp_path / "cp1" / "grads.pt", config, PRETRAIN, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", config, [*PRETRAIN, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)


@pytest.mark.long  # ~60 s on two cores: packed SFT under CP=2 runs in the default tier for GPT attention
def test_mla_packed_sft_cp2_matches_one_process(tmp_path, data_cache):
    """Packed SFT through MLA (megatron pads the values to the query head dim for THD). The router's
    load-balancing loss is off here: under CP every conversation is padded to a multiple of 2*cp, and
    megatron's router counts those pad tokens in its auxiliary loss, which moves the router's
    gradient by ~1e-3 relative to one process (the language-model loss and other gradients agree)."""
    sft = [*SFT, "train.micro_batch_size=1", "recipe=sft", "model.moe_aux_loss_coeff=0"]
    want = probe(tmp_path / "cp1" / "grads.pt", "train_deepseek_v3_debug", sft, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", "train_deepseek_v3_debug", [*sft, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)
