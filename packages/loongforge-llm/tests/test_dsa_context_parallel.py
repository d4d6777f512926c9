"""DeepSeek-V3.2's sparse attention (DSA) under context parallelism (``families.dsa_context_parallel``):
each CP rank all-gathers the latent KV rows and the indexer keys, and runs its two query chunks
(per packed sequence, for packed SFT rows) against their causal prefixes. Two processes (gloo,
fp32) train like one, for pre-training and packed SFT rows: the same losses and, after the first
step, the same gradient of every parameter (``tests/llm_grad_probe.py``); so do four, TP=2 x CP=2
(TP rank 0's shard of the parameters TP splits). On one process, the pieces: which keys each local
chunk sees (never another packed sequence's), which local rows are CP's padding, and a top-k that
picks the same keys for a chunk as for the whole sequence, exact-zero ties included."""

import pytest
import torch
from llm_grad_probe import PRETRAIN, assert_same_training, probe

from loongforge.llm.families.dsa_context_parallel import query_pieces, real_query_rows
from loongforge.llm.layers.context_parallel_attention import thd_zigzag_index, zigzag_index
from loongforge.llm.ops.dsa import dsa_indexer_topk


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_query_chunks_are_the_ranks_rows_against_their_causal_prefix(cp):
    s = 16 * cp
    for rank in range(cp):
        positions = zigzag_index(s, cp, rank)
        pieces = query_pieces(s // cp, cp, rank)
        assert [t for t0, t1, _, _ in pieces for t in range(t0, t1)] == list(range(s // cp))
        for t0, t1, k0, k1 in pieces:  # the chunk's rows are the last t1 - t0 of positions [0, k1)
            assert k0 == 0 and positions[t0:t1].tolist() == list(range(k1 - (t1 - t0), k1))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_query_chunks_see_only_their_own_sequence(cp):
    """A packed row of four sequences (one empty), each padded to a multiple of 2*cp: every local
    row's keys are its own sequence's, up to and including itself."""
    bounds = [0, 8 * cp, 8 * cp, 20 * cp, 24 * cp]
    for rank in range(cp):
        rows = thd_zigzag_index(torch.tensor(bounds), cp, rank) if cp > 1 else torch.arange(bounds[-1])
        pieces = query_pieces(bounds[-1] // cp, cp, rank, bounds)
        assert [t for t0, t1, _, _ in pieces for t in range(t0, t1)] == list(range(bounds[-1] // cp))
        for t0, t1, k0, k1 in pieces:
            assert k0 in bounds and k1 <= min(b for b in bounds if b > k0)  # one sequence
            assert rows[t0:t1].tolist() == list(range(k1 - (t1 - t0), k1))  # its causal prefix
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        query_pieces(6, 2, 0, [0, 6, 12])


def test_real_query_rows_leave_out_the_padding_of_each_sequence():
    """Sequences of 5, 7 and 2 tokens padded to 8, 8 and 4 for cp=2: over both ranks, the real
    rows are exactly the first 5, 7 and 2 of each padded segment."""
    cu, padded = torch.tensor([0, 5, 12, 14]), torch.tensor([0, 8, 16, 20])
    real = torch.zeros(20, dtype=torch.bool)
    for rank in range(2):
        real[thd_zigzag_index(padded, 2, rank)] = real_query_rows(cu, padded, 2, rank)
    want = torch.zeros(20, dtype=torch.bool)
    for start, n in ((0, 5), (8, 7), (16, 2)):
        want[start : start + n] = True
    assert torch.equal(real, want)


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
    for t0, t1, _, keys in query_pieces(s // 2, 2, 0) + query_pieces(s // 2, 2, 1):
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


# 8 conversations of uneven lengths a step, packed into rows of up to 256 positions; the router's
# load-balancing loss off: megatron's router counts CP's pad tokens in it (test_context_parallel_training)
SFT = ["train.global_batch_size=8", "train.seq_length=256", "train.micro_batch_size=1", "recipe=sft",
       "model.moe_aux_loss_coeff=0"]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("loss", ["dense", "sparse"])
def test_dsa_packed_sft_cp2_matches_one_process(loss, tmp_path):
    """Packed SFT rows (several conversations per row, cu_seqlens): on one process each
    conversation is its own piece; with parallel.cp=2 each is padded to a multiple of 4 and split,
    and the indexer loss leaves the padding out."""
    data = tmp_path / "data"
    run = [*SFT, f"model.dsa_indexer_use_sparse_loss={str(loss == 'sparse').lower()}"]
    want = probe(tmp_path / "cp1" / "grads.pt", "train_deepseek_v3_2_debug", run, data)
    got = probe(tmp_path / "cp2" / "grads.pt", "train_deepseek_v3_2_debug", [*run, "parallel.cp=2"], data, nproc=2)
    assert_same_training(got, want)
    assert any(".core_attention.indexer." in name for name in want["grads"])
    (b, s), (b2, s2) = want["first_tokens_shape"], got["first_tokens_shape"]
    assert b == b2 == 1 and s // 2 <= s2 < s  # one packed row, each conversation split over the CP ranks


@pytest.mark.slow
@pytest.mark.long
def test_dsa_packed_sft_tp2_cp2_matches_one_process(tmp_path):
    """TP=2 x CP=2 (four processes): the attention heads split over TP (the indexer, duplicated,
    keeps all its heads on every rank, so the same top-k; the indexer loss's target all-reduced
    over TP per piece; the key's gradient summed over TP, ``RegistryDSAttention._key_summed_over_tp``),
    each packed conversation split over CP."""
    data = tmp_path / "data"
    want = probe(tmp_path / "one" / "grads.pt", "train_deepseek_v3_2_debug", SFT, data)
    got = probe(tmp_path / "tp2cp2" / "grads.pt", "train_deepseek_v3_2_debug", [*SFT, "parallel.tp=2", "parallel.cp=2"],
                data, nproc=4)
    assert_same_training(got, want)  # every gradient, TP rank 0's shard of those TP splits
    assert any(".core_attention.indexer." in name for name in set(want["grads"]) - set(got["tp_split"]))
    assert any(".linear_q_up_proj." in name for name in got["tp_split"])  # the heads were split
