"""Qwen3.5 under parallel.tp=2 (two processes, gloo, fp32) trains like one process, for pre-training
rows and packed SFT rows, the MoE family (under sequence parallelism) on pre-training rows, and
with parallel.cp=2 too (four processes): the same losses, grad norms and first-step gradient of every parameter,
whole (``tests/llm_grad_probe.py``'s ``whole_grads``: each gradient put together from every
rank's regions under its checkpoint key, as the sharded state dict describes them; the Gated
DeltaNet's fused ``in_proj_qkv`` and ``conv1d`` hold three sections per rank). Each TP rank runs
its own DeltaNet heads and half of the gated attention's query groups.

Each test is two training runs (one of them two processes), a minute or more alone: they are
marked ``long``. The default run's TP check is the one-layer
``tests/test_llm_qwen3_5.py::test_delta_net_tensor_parallel_equals_one_process[tp2]``."""

import pytest
import torch
from llm_grad_probe import PRETRAIN, probe


def assert_same_whole_gradients(got: dict, want: dict) -> None:
    """The same losses and grad norms (rtol 1e-4), and every whole gradient to rtol 1e-4 with an
    absolute floor of 1e-4 of the largest gradient entry (the DeltaNet's decay parameters get sums
    of terms that cancel to ~1e-4 of their size)."""
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
    assert sorted(got["whole_grads"]) == sorted(want["whole_grads"]) and want["whole_grads"]
    assert any(".self_attention.in_proj_qkv.weight" in key for key in want["whole_grads"])
    floor = 1e-4 * max(float(ref.abs().max()) for ref in want["whole_grads"].values())
    for key, ref in want["whole_grads"].items():
        torch.testing.assert_close(got["whole_grads"][key], ref, rtol=1e-4, atol=floor,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.long  # two training runs, one of two processes
def test_qwen3_5_pretraining_tp2_matches_one_process(tmp_path_factory):
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_tp")
    want = probe(work / "tp1" / "grads.pt", "qwen3_5_debug", PRETRAIN, cache, whole_grads=True)
    got = probe(work / "tp2" / "grads.pt", "qwen3_5_debug", [*PRETRAIN, "parallel.tp=2"], cache, nproc=2,
                whole_grads=True)
    assert_same_whole_gradients(got, want)
    assert any(".self_attention.in_proj_qkv." in name for name in got["tp_split"])


@pytest.mark.slow
@pytest.mark.long  # two training runs, one of two processes
def test_qwen3_5_packed_sft_tp2_matches_one_process(tmp_path_factory):
    """Conversations of uneven lengths packed into rows: each TP rank's DeltaNet heads restart their
    state at every packed sequence's bound."""
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_sft_tp")
    sft = ["train.global_batch_size=8", "train.seq_length=256", "sft.packing=true", "model=qwen3_5_debug"]
    want = probe(work / "tp1" / "grads.pt", "sft_debug", sft, cache, whole_grads=True)
    got = probe(work / "tp2" / "grads.pt", "sft_debug", [*sft, "parallel.tp=2"], cache, nproc=2, whole_grads=True)
    assert_same_whole_gradients(got, want)


@pytest.mark.slow
@pytest.mark.long  # two training runs, one of two processes
def test_qwen3_5_moe_pretraining_tp2_matches_one_process(tmp_path_factory):
    """The MoE family turns on sequence parallelism under TP (megatron's MoE layer needs it): each
    DeltaNet layer all-gathers its input over the sequence and reduce-scatters its output."""
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_moe_tp")
    moe = [*PRETRAIN, "model=qwen3_5_moe_debug"]
    want = probe(work / "tp1" / "grads.pt", "qwen3_5_debug", moe, cache, whole_grads=True)
    got = probe(work / "tp2" / "grads.pt", "qwen3_5_debug", [*moe, "parallel.tp=2"], cache, nproc=2, whole_grads=True)
    assert_same_whole_gradients(got, want)


@pytest.mark.slow
@pytest.mark.long  # two training runs, one of four processes
def test_qwen3_5_pretraining_tp2_cp2_matches_one_process(tmp_path_factory):
    """TP and CP together: each TP rank's DeltaNet heads hand their state and convolution tail over
    its CP group."""
    cache, work = tmp_path_factory.mktemp("llm-data"), tmp_path_factory.mktemp("qwen3_5_tp_cp")
    want = probe(work / "one" / "grads.pt", "qwen3_5_debug", PRETRAIN, cache, whole_grads=True)
    got = probe(work / "tp2cp2" / "grads.pt", "qwen3_5_debug", [*PRETRAIN, "parallel.tp=2", "parallel.cp=2"], cache,
                nproc=4, whole_grads=True)
    assert_same_whole_gradients(got, want)
