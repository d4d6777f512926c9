"""DeepSeek-V3.2's sparse attention (DSA) under parallel.cp=2 (two processes, gloo, fp32) trains like
one process: the same losses and, after the first step, the same gradient of every parameter
(``tests/llm_grad_probe.py``)."""

import pytest
from llm_grad_probe import PRETRAIN, assert_same_training, probe


def test_dsa_pretraining_cp2_matches_one_process(tmp_path):
    want = probe(tmp_path / "cp1" / "grads.pt", "train_deepseek_v3_2_debug", PRETRAIN, tmp_path / "data")
    got = probe(tmp_path / "cp2" / "grads.pt", "train_deepseek_v3_2_debug", [*PRETRAIN, "parallel.cp=2"],
                tmp_path / "data", nproc=2)
    assert_same_training(got, want)
