"""DeepSeek-V3.2's sparse attention (DSA) under context parallelism (``families.dsa_context_parallel``):
each CP rank all-gathers the latent KV rows and the indexer keys, and runs its two query chunks
against their causal prefixes. Two processes (gloo, fp32) train like one: the same losses and,
after the first step, the same gradient of every parameter (``tests/llm_grad_probe.py``); on one
process, the pieces: which keys each local chunk sees, and a top-k that picks the same keys for a
chunk as for the whole sequence, exact-zero ties included."""

import pytest
import torch
from llm_grad_probe import PRETRAIN, assert_same_training, probe

from loongforge.llm.families.dsa_context_parallel import query_chunks
from loongforge.llm.layers.context_parallel_attention import zigzag_index
from loongforge.llm.ops.dsa import dsa_indexer_topk


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_query_chunks_are_the_ranks_rows_against_their_causal_prefix(cp):
    s = 16 * cp
    for rank in range(cp):
        positions = zigzag_index(s, cp, rank)
        chunks = query_chunks(s // cp, cp, rank)
        assert [t for t0, t1, _ in chunks for t in range(t0, t1)] == list(range(s // cp))
        for t0, t1, keys in chunks:  # the chunk's rows are the last t1 - t0 of the first `keys` positions
            assert positions[t0:t1].tolist() == list(range(keys - (t1 - t0), keys))


def test_topk_of_a_query_chunk_is_the_whole_sequences_despite_ties():
    """4 indexer heads with ReLU: a key whose 4 dot products are all negative scores exactly 0,
    so many keys tie; the chunk's top-k (fewer keys in its rows) keeps the same ones."""
    g = torch.Generator().manual_seed(0)
    b, s, heads, dim, topk = 2, 64, 4, 8, 12
    q, k = torch.randn(b, s, heads, dim, generator=g), torch.randn(b, s, dim, generator=g)
    w = torch.randn(b, s, heads, generator=g)
    whole = dsa_indexer_topk(q, k, w, topk)
    zero = torch.einsum("bthd,bsd->bths", q, k).relu().sum(2) == 0
    assert zero.tril().sum() > s  # plenty of exact-zero scores among the causal keys
    for t0, t1, keys in query_chunks(s // 2, 2, 0) + query_chunks(s // 2, 2, 1):
        t0, t1 = keys - (t1 - t0), keys  # the chunk's global rows
        part = dsa_indexer_topk(q[:, t0:t1], k[:, :keys], w[:, t0:t1], topk)
        assert torch.equal(part.sort(-1).values, whole[:, t0:t1].sort(-1).values)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("loss", ["dense", "sparse"])
def test_dsa_pretraining_cp2_matches_one_process(loss, tmp_path):
    """The debug DeepSeek-V3.2 (32 of 64 keys per query) with parallel.cp=2; the indexer's KL loss
    over every causal key (dense) or over the selected ones (sparse)."""
    data = tmp_path / "data"
    run = [*PRETRAIN, f"model.dsa_indexer_use_sparse_loss={str(loss == 'sparse').lower()}"]
    want = probe(tmp_path / "cp1" / "grads.pt", "train_deepseek_v3_2_debug", run, data)
    got = probe(tmp_path / "cp2" / "grads.pt", "train_deepseek_v3_2_debug", [*run, "parallel.cp=2"], data, nproc=2)
    assert_same_training(got, want)
    assert any(".core_attention.indexer." in name for name in want["grads"])  # the indexer's loss trains it
    b, s = want["first_tokens_shape"]
    assert got["first_tokens_shape"] == (b, s // 2)  # each CP rank holds half of every row
