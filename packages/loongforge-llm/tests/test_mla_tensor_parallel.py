"""Multi-latent attention (DeepSeek-V3) under tensor parallelism trains as one process does, in
every gradient: the rope part of the key is one vector per token shared by every head, and
``LatentSDPAttention`` sums its gradient over TP (megatron's local MLA gathers the column-parallel
down projection's output with a backward that only splits, so each TP rank's slice of
``linear_kv_down_proj`` and of the norm before it would learn from its own heads only; the
losses and gradient norms hardly show it, the layer-norm and down-projection gradients do)."""

import pytest
from llm_grad_probe import PRETRAIN, assert_same_training, probe


@pytest.mark.long  # a two-process layout, 48 s: in the long tier
@pytest.mark.slow
def test_mla_tp2_matches_one_process_in_every_gradient(tmp_path):
    data = tmp_path / "data"
    want = probe(tmp_path / "one" / "grads.pt", "train_deepseek_v3_debug", PRETRAIN, data)
    got = probe(tmp_path / "tp2" / "grads.pt", "train_deepseek_v3_debug", [*PRETRAIN, "parallel.tp=2"], data, nproc=2)
    assert_same_training(got, want)  # TP rank 0's shard of the parameters TP splits
    assert any(".linear_kv_down_proj." in name for name in got["tp_split"])
    assert any(".input_layernorm." in name for name in set(want["grads"]) - set(got["tp_split"]))
