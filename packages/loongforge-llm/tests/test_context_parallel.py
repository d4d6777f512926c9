"""Context parallelism's pieces on one process: the load-balanced split and its inverse, the
global RoPE positions, and the CP attention of every simulated rank against full-sequence SDPA."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from host_reads import counted_reads

from loongforge.llm.layers.attention import causal_mask
from loongforge.llm.data.packing import cp_share, pack
from loongforge.llm.layers.context_parallel_attention import (
    GatheredLayout,
    dense_local_attention,
    local_positions,
    natural_order,
    packed_local_attention,
    thd_zigzag_index,
    zigzag_index,
)


def sdpa(q, k, v, mask, causal):
    mask, causal = causal_mask(mask, causal, q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_dense_split_round_trip(cp):
    s = 8 * cp
    x = torch.arange(s)
    indices = [zigzag_index(s, cp, r) for r in range(cp)]
    c = s // (2 * cp)
    for r, index in enumerate(indices):  # rank r keeps chunks r and 2cp-1-r
        assert index.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert local_positions(s // cp, cp, r, None).tolist() == index.tolist()
    gathered = torch.cat([x[i] for i in indices])
    assert torch.equal(gathered[natural_order(indices)], x)
    assert torch.equal(GatheredLayout().order(s // cp, cp, None), natural_order(indices))


def test_dense_split_needs_2cp_chunks():
    with pytest.raises(ValueError, match="2\\*cp = 4"):
        zigzag_index(10, 2, 0)


def test_packed_split_per_segment_and_round_trip():
    cu = torch.tensor([0, 8, 8, 20, 24], dtype=torch.int32)  # segments of 8, 0, 12, 4 (multiples of 4)
    idx = [thd_zigzag_index(cu, 2, r) for r in range(2)]
    assert idx[0].tolist() == [0, 1, 6, 7] + [8, 9, 10, 17, 18, 19] + [20, 23]
    assert idx[1].tolist() == [2, 3, 4, 5] + [11, 12, 13, 14, 15, 16] + [21, 22]
    x = torch.arange(24)
    assert torch.equal(torch.cat([x[i] for i in idx])[natural_order(idx)], x)
    # RoPE positions restart in every segment
    assert local_positions(12, 2, 1, cu).tolist() == [2, 3, 4, 5] + [3, 4, 5, 6, 7, 8] + [1, 2]


def test_pack_pads_segments_and_cp_share_splits_them():
    samples = [{"tokens": [1, 2, 3], "labels": [2, 3, 4], "loss_mask": [1, 1, 1]},
               {"tokens": [5, 6, 7, 8, 9], "labels": [6, 7, 8, 9, 10], "loss_mask": [0, 1, 1, 1, 1]}]
    row = pack(samples, pad_to=16, pad_id=0, pad_multiple=4)
    assert row["cu_seqlens"].tolist() == [0, 3, 8, 12]  # the samples' own lengths, as TE takes them
    assert row["cu_seqlens_padded"].tolist() == [0, 4, 12, 16]
    assert row["tokens"].tolist() == [[1, 2, 3, 0, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0]]
    assert row["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert row["max_seqlen"] == 8
    shares = [cp_share(row, 2, r) for r in range(2)]
    assert shares[0]["tokens"].tolist() == [[1, 0, 5, 6, 0, 0, 0, 0]]
    assert shares[1]["tokens"].tolist() == [[2, 3, 7, 8, 9, 0, 0, 0]]
    for share in shares:  # the row's metadata stays whole
        assert torch.equal(share["cu_seqlens_padded"], row["cu_seqlens_padded"])
    # each rank's positions are its tokens' global positions, as local_positions computes them
    for r, share in enumerate(shares):
        assert share["position_ids"][0].tolist() == local_positions(8, 2, r, row["cu_seqlens_padded"]).tolist()


def test_each_forward_reads_its_own_packed_layout_once_for_all_layers():
    """Two forwards whose packed rows are equally long but cut differently, four layers each: every
    layer gets its own forward's bounds and gathered-row order, and only the first layer of each
    forward reads the bounds back (``tolist``, and one row count per CP rank for the order)."""
    from loongforge.llm.data.packing import packed_seq_params
    from loongforge.llm.layers.packed_params import forward_layout

    reads = []
    cp, orders = 2, []
    for bounds in ([0, 8, 20, 24], [0, 4, 24]):
        cu = counted_reads(torch.tensor(bounds, dtype=torch.int32), reads)
        params = packed_seq_params({"cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": 20})
        want = natural_order([thd_zigzag_index(torch.tensor(bounds), cp, r) for r in range(cp)])
        reads.clear()
        for _layer in range(4):
            layout = forward_layout(params, params.cu_seqlens_q_padded)
            assert layout.bounds() == bounds
            assert torch.equal(layout.order(12, cp, torch.device("cpu")), want)
        assert sorted(reads) == ["__int__", "__int__", "tolist"]
        orders.append(want)
    assert not torch.equal(orders[0], orders[1])  # the two forwards' layouts differ
    # params copied with other bounds get those bounds' layout, not the original's
    other = torch.tensor([0, 12, 24], dtype=torch.int32)
    copied = dataclasses.replace(params, cu_seqlens_q_padded=other, cu_seqlens_kv_padded=other)
    assert forward_layout(copied, other).bounds() == [0, 12, 24]


def test_cp_rope_positions_are_read_once_per_forward_for_every_model():
    """Under CP, a packed row's RoPE positions (a host read of its bounds) are computed by the
    first tables that need them and kept on the forward's layout: two models' tables (angles of
    different base and dims), two layers each, read the bounds once, and each layer gets its own
    model's angles at its tokens' global positions; each model's layers share its tables."""
    from loongforge.llm.data.packing import packed_seq_params
    from loongforge.llm.layers.packed_params import forward_layout
    from loongforge.llm.layers.rope_tables import RopeTables

    bounds, cp, n_local = [0, 8, 20, 24], (2, 1), 12
    reads = []
    cu = counted_reads(torch.tensor(bounds, dtype=torch.int32), reads)
    params = packed_seq_params({"cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": 12})
    positions = local_positions(n_local, *cp, torch.tensor(bounds))
    assert positions.tolist() == [2, 3, 4, 5] + [3, 4, 5, 6, 7, 8] + [1, 2]
    models = {}
    for name, base, dims in (("a", 10000.0, 4), ("b", 500.0, 6)):
        inv_freq = base ** -(torch.arange(0, dims, 2) / dims)
        freqs = torch.outer(torch.arange(24.0), inv_freq)
        models[name] = (RopeTables(), torch.cat([freqs, freqs], -1)[:, None, None])  # megatron's [s, 1, 1, dim]
    built = {name: [] for name in models}
    for _layer in range(2):
        for name, (tables, angles) in models.items():
            layout = forward_layout(params, params.cu_seqlens_q_padded)
            cos, sin = tables.get(angles, (n_local, 1, 2), cu, None, cp, layout=layout)
            torch.testing.assert_close(cos[:, 0, 1], angles[positions, 0, 0].cos(), rtol=0, atol=0)
            torch.testing.assert_close(sin[:, 0, 0], angles[positions, 0, 0].sin(), rtol=0, atol=0)
            built[name].append(cos)
    assert reads == ["__int__"]  # the row length of the first model's first layer, nothing more
    assert all(a is b for a, b in built.values())  # a model's second layer reuses its tables
    assert built["a"][0].shape[-1] == 4 and built["b"][0].shape[-1] == 6


def _qkv(lead_shape, heads=4, groups=2, d=8):
    """Random fp64 queries, keys and values (GQA: ``groups`` K/V heads) that require grad."""
    torch.manual_seed(0)
    q = torch.randn(*lead_shape, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*lead_shape, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*lead_shape, groups, d, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("cp", [2, 3])
def test_dense_cp_attention_matches_full_sdpa(cp):
    s, b = 12 * cp, 2
    q, k, v = _qkv((s, b))
    w = torch.randn(s, b, 4, 8, dtype=torch.float64)
    ref = sdpa(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), None, True).permute(2, 0, 1, 3)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))

    out = torch.zeros_like(ref)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):  # each rank: its queries against the whole K/V (the gathered, reordered ones)
        index = zigzag_index(s, cp, r)
        local = dense_local_attention(sdpa, q[index], k, v, cp, r)
        # the sum of every rank's dK/dV is what the backward's reduce-scatter hands each rank
        for acc, g in zip(grads, torch.autograd.grad((local * w[index]).sum(), (q, k, v))):
            acc += g
        out[index] = local.detach()
    torch.testing.assert_close(out, ref.detach())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_packed_cp_attention_matches_per_segment_sdpa():
    cp, lengths = 2, [5, 11, 1, 8]  # uneven; padded to multiples of 4: 8, 12, 4, 8
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
    t = int(cu[-1])
    q, k, v = _qkv((t,))
    real = torch.cat([torch.arange(int(a), int(a) + n) for a, n in zip(cu[:-1], lengths)])  # non-pad rows
    w = torch.randn(t, 4, 8, dtype=torch.float64)
    w[~torch.isin(torch.arange(t), real)] = 0  # pads carry no loss

    ref = torch.zeros(t, 4, 8, dtype=torch.float64)
    pieces = []
    for a, n in zip(cu[:-1].tolist(), lengths):  # each real segment alone, causal, no pads
        seg = sdpa(q[a:a + n].transpose(0, 1)[None], k[a:a + n].transpose(0, 1)[None],
                   v[a:a + n].transpose(0, 1)[None], None, True)[0].transpose(0, 1)
        pieces.append(seg)
    ref_real = torch.cat(pieces)
    ref_grads = torch.autograd.grad((ref_real * w[real]).sum(), (q, k, v))

    out = torch.zeros_like(ref)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for r in range(cp):
        index = thd_zigzag_index(cu, cp, r)
        local = packed_local_attention(sdpa, q[index], k, v, cu.tolist(), cp, r)
        for acc, g in zip(grads, torch.autograd.grad((local * w[index]).sum(), (q, k, v))):
            acc += g
        out[index] = local.detach()
    torch.testing.assert_close(out[real], ref_real.detach())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got[real], want[real])


@pytest.mark.parametrize("config, overrides, message", [
    ("train_debug", ["train.seq_length=66"], "parallel.cp=2: train.seq_length=66 must be a multiple of 2*cp = 4"),
    ("train_deepseek_v3_2_debug", ["recipe=sft", "train.micro_batch_size=1", "sft.packing=false"],
     "parallel.cp=2: model.attention_variant=dsa (DeepSeek-V3.2 sparse attention) with recipe=sft needs sft.packing=true"),
])
def test_unsupported_cp_configs_are_refused_before_any_process_group(config, overrides, message):
    from loongforge.core.config import ConfigError
    from loongforge.llm.recipe import load_llm_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_llm_config(config, ["parallel.cp=2", *overrides])


def test_dsa_cp_loads_with_packed_sft_and_tensor_parallel():
    """DeepSeek-V3.2's sparse attention under CP with packed SFT rows and TP=2 (refused before)."""
    from loongforge.llm.recipe import load_llm_config

    cfg = load_llm_config("train_deepseek_v3_2_debug", ["parallel.cp=2", "parallel.tp=2", "recipe=sft",
                                                     "train.micro_batch_size=1"])
    assert (cfg.parallel.cp, cfg.parallel.tp, cfg.recipe) == (2, 2, "sft")


def test_per_token_rope_angles_are_used_as_given():
    """Multimodal RoPE angles (one row per token of the layer's input, from each token's own
    position) are neither re-indexed per packed segment nor per CP rank."""
    from loongforge.llm.layers.rope_tables import RopeTables

    angles = torch.randn(8, 1, 1, 4)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    for cp in [(1, 0), (2, 1)]:
        cos, sin = RopeTables().get(angles, (8, 1, 2), cu, None, cp, per_token=True)
        torch.testing.assert_close(cos[:, 0, 0], angles[:, 0, 0].cos())
        torch.testing.assert_close(sin[:, 0, 1], angles[:, 0, 0].sin())
    segment_wise, _ = RopeTables().get(angles, (8, 1, 2), cu)  # 1-D RoPE: by position in the segment
    torch.testing.assert_close(segment_wise[4:, 0, 0], angles[:4, 0, 0].cos())
    with pytest.raises(ValueError, match="8 rows for 4 tokens"):
        RopeTables().get(angles, (4, 1, 2), None, None, (2, 0), per_token=True)
