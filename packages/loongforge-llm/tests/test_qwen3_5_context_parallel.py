"""Qwen3.5 under parallel.cp=2 (two processes, gloo, fp32) trains like one process, for pre-training
rows and packed SFT rows: the same losses, grad norms and first-step gradient of every parameter
(``tests/llm_grad_probe.py``; ``assert_same_gradients`` for the gradients' tolerance). The Gated
DeltaNet layers hand their recurrent state and convolution tail from rank to rank; the gated
attention layers attend over the whole sequences (the fast layer's CP path).

Each test is two training runs (one of them two processes), a minute or more alone: they are
marked ``long``. The default run's CP check is the one-layer
``tests/test_llm_qwen3_5.py::test_delta_net_context_parallel_equals_one_process[2]``."""

import pytest
import torch
from llm_grad_probe import PRETRAIN, assert_same_training, probe


def assert_same_gradients(got: dict, want: dict) -> None:
    """Every gradient to rtol 1e-4 with an absolute floor of 1e-4 of the largest gradient entry of the
    model: the DeltaNet's decay parameters (A_log, dt_bias) get sums of terms that cancel to ~1e-4
    of their size, so the two runs' different chunkings of the fp32 recurrence differ there at the
    rounding of those terms, not of the small sum."""
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"]
    floor = 1e-4 * max(float(ref.abs().max()) for ref in want["grads"].values())
    for name, ref in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-4, atol=floor,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.long  # ~65 s alone
def test_qwen3_5_pretraining_cp2_matches_one_process(tmp_path_factory):
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_cp")
    want = probe(work / "cp1" / "grads.pt", "qwen3_5_debug", PRETRAIN, cache)
    got = probe(work / "cp2" / "grads.pt", "qwen3_5_debug", [*PRETRAIN, "parallel.cp=2"], cache, nproc=2)
    assert_same_training(got, want, grads=False)
    assert_same_gradients(got, want)
    b, s = want["first_tokens_shape"]
    assert got["first_tokens_shape"] == (b, s // 2)  # each CP rank holds half of every row


@pytest.mark.slow
@pytest.mark.long  # ~70 s alone
def test_qwen3_5_packed_sft_cp2_matches_one_process(tmp_path_factory):
    """Conversations of uneven lengths packed into rows (each padded to a multiple of 2*cp and split
    per sequence): the DeltaNet's state and tail hand-overs run per packed sequence."""
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_sft_cp")
    sft = ["train.global_batch_size=8", "train.seq_length=256", "sft.packing=true", "model=qwen3_5_debug"]
    want = probe(work / "cp1" / "grads.pt", "sft_debug", sft, cache)
    got = probe(work / "cp2" / "grads.pt", "sft_debug", [*sft, "parallel.cp=2"], cache, nproc=2)
    assert_same_training(got, want, grads=False)
    assert_same_gradients(got, want)


@pytest.mark.slow
@pytest.mark.long  # ~110 s alone
def test_qwen3_5_moe_pretraining_cp2_matches_one_process(tmp_path_factory):
    """The MoE family (megatron's MoE layers and attention) under CP: the same DeltaNet hand-overs."""
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_moe_cp")
    moe = [*PRETRAIN, "model=qwen3_5_moe_debug"]
    want = probe(work / "cp1" / "grads.pt", "qwen3_5_debug", moe, cache)
    got = probe(work / "cp2" / "grads.pt", "qwen3_5_debug", [*moe, "parallel.cp=2"], cache, nproc=2)
    assert_same_training(got, want, grads=False)
    assert_same_gradients(got, want)
