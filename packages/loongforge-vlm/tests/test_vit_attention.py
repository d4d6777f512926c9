"""The ViT's segment attention: segment boundaries from the ids, and its two kernels.

On CPU: ``segment_cu_seqlens`` recovers the frame and window boundaries of the encoder's
(permuted) patch order, and the masked SDPA path equals attention computed one segment at a
time over those boundaries (the semantics of the variable-length kernel). The variable-length
path's own arithmetic (with the encoder's ``SegmentBounds`` or finding its row's boundaries itself)
runs with a per-segment reference in the kernel's place, and the whole encoder's block takes the
bounds through megatron's ``packed_seq_params`` unchanged. On CUDA, the variable-length flash path
is compared against the masked path, forward and backward.
"""

import pytest
import torch
import torch.nn.functional as F

from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.attention import (FULL, WINDOW, SegmentAttention, SegmentBounds, segment_cu_seqlens,
                                               segment_ids)

MERGE, WINDOW_UNITS = 2, 2
GRIDS = torch.tensor([[1, 8, 12], [2, 6, 4], [1, 10, 6]])  # windows that do not tile every frame


def encoder_segments(grid_thw):
    """The ``[2, s]`` frame/window ids in the encoder's permuted patch order (as ``VisionEncoder``
    builds them) and the window lengths ``window_order`` reports."""
    total = sum(geometry.patch_counts(grid_thw))
    units, lengths = geometry.window_order(grid_thw, MERGE, WINDOW_UNITS)
    perm = geometry.expand_units(units, MERGE)
    frames = segment_ids(geometry.frame_cu_seqlens(grid_thw), total)[perm]
    windows = segment_ids(F.pad(lengths.cumsum(0), (1, 0)), total)
    return torch.stack([frames, windows]), lengths


def test_cu_seqlens_invert_segment_ids():
    lengths = torch.tensor([3, 1, 7, 2, 5])
    cu = F.pad(lengths.cumsum(0), (1, 0))
    got, longest = segment_cu_seqlens(segment_ids(cu, int(lengths.sum())) * 3 + 10)  # any increasing values
    assert got.dtype == torch.int32
    assert got.tolist() == cu.tolist()
    assert longest == 7


def test_cu_seqlens_of_the_encoder_order():
    segments, window_lengths = encoder_segments(GRIDS)
    frames, longest_frame = segment_cu_seqlens(segments[FULL])
    windows, longest_window = segment_cu_seqlens(segments[WINDOW])
    assert frames.tolist() == geometry.frame_cu_seqlens(GRIDS).tolist()  # frames stay contiguous after the permutation
    assert longest_frame == int((GRIDS[:, 1] * GRIDS[:, 2]).max())
    assert windows.tolist() == F.pad(window_lengths.cumsum(0), (1, 0)).tolist()
    assert longest_window == int(window_lengths.max()) == (MERGE * WINDOW_UNITS) ** 2


def test_cu_seqlens_refuse_bad_ids():
    with pytest.raises(ValueError, match="non-decreasing"):
        segment_cu_seqlens(torch.tensor([0, 0, 1, 1, 0]))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        segment_cu_seqlens(torch.zeros(0, dtype=torch.long))


def attention(megatron_world, heads, groups, segment_row, device="cpu"):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=16, attention_dropout=0.0)
    return SegmentAttention(config, layer_number=1, attn_mask_type=None, pg_collection=megatron_world.pgs,
                            segment_row=segment_row).to(device)


def per_segment_reference(query, key, value, cu_seqlens, scale):
    """Attention of each ``cu_seqlens`` segment on its own, ``[s, b, h, d] -> [s, b, h * d]`` (fp32)."""
    repeat = query.shape[2] // key.shape[2]
    pieces = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].float().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, len, d]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        pieces.append(F.scaled_dot_product_attention(q, k, v, scale=scale).permute(2, 0, 1, 3))
    out = torch.cat(pieces)
    return out.reshape(*out.shape[:2], -1)


@pytest.mark.parametrize("row", [FULL, WINDOW])
@pytest.mark.parametrize("batch, heads, groups", [(1, 2, 2), (2, 4, 2)])
def test_masked_path_equals_per_segment_attention(megatron_world, row, batch, heads, groups):
    segments, _ = encoder_segments(GRIDS)
    s = segments.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, batch, heads, 16, generator=g)
    k, v = (torch.randn(s, batch, groups, 16, generator=g) for _ in range(2))
    module = attention(megatron_world, heads, groups, row)
    got = module(q, k, v, segments)
    cu, _ = segment_cu_seqlens(segments[row])
    torch.testing.assert_close(got, per_segment_reference(q, k, v, cu, module.softmax_scale), atol=1e-5, rtol=1e-5)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What ``torch.nn.attention.varlen.varlen_attn`` computes, ``[t, h, d]`` packed (fp32, per segment)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = per_segment_reference(q[:, None], k[:, None], v[:, None], cu_q, scale)
    return out.reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("given", [True, False], ids=["encoder_bounds", "own_bounds"])
@pytest.mark.parametrize("row", [FULL, WINDOW])
def test_varlen_arithmetic_equals_the_masked_path(megatron_world, monkeypatch, row, given):
    """The flash path's packing, batch folding and boundaries, with a per-segment reference as the
    kernel: from the encoder's bounds no boundary is looked for again (the host sync per layer)."""
    from loongforge.vlm.encoders import attention as segment_attention

    segments, _ = encoder_segments(GRIDS)
    s, batch, heads = segments.shape[1], 2, 4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, batch, heads, 16, generator=g)
    k, v = (torch.randn(s, batch, 2, 16, generator=g) for _ in range(2))
    k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))  # (the varlen kernel takes as many k/v heads as q)
    module = attention(megatron_world, heads, heads, row)
    bounds = SegmentBounds.of(segments) if given else None
    looked_up = []
    real = segment_attention.segment_cu_seqlens
    monkeypatch.setattr(segment_attention, "segment_cu_seqlens", lambda ids: looked_up.append(1) or real(ids))
    got = module._varlen(lambda *a, scale: reference_varlen(*a, scale=scale), q, k, v, segments[row], bounds)
    assert len(looked_up) == (0 if given else 1)
    expected = module._masked(q, k, v, segments[row], dropout=0.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_segment_bounds_pass_through_the_encoders_block(megatron_world, recompute):
    """The encoder's megatron block with ``SegmentBounds`` as ``packed_seq_params`` (its CUDA form)
    gives what it gives without them, forward and backward, with and without megatron's activation
    recompute: megatron's attention leaves an ``sbhd`` layout and the rotary path alone (on CPU the
    layers then run the masked path)."""
    from megatron.core.transformer import TransformerConfig

    from loongforge.vlm.encoders import build_encoder
    from loongforge.vlm.encoders.layers import encoder_transformer_config
    from loongforge.vlm.encoders.qwen2_5_vit import QwenViTConfig

    cfg = QwenViTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                        window_size=WINDOW_UNITS * MERGE * 8, full_attention_layers=[1])
    foundation = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    encoder = build_encoder(cfg, encoder_transformer_config(cfg, 1, recompute, foundation), megatron_world.pgs)
    encoder.train()
    segments, _ = encoder_segments(GRIDS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(segments.shape[1], 1, 64, generator=g)
    rot = torch.randn(segments.shape[1], 1, 1, 16, generator=g)
    bounds = SegmentBounds.of(segments)
    assert [cu.tolist() for cu, _ in bounds.rows] == [segment_cu_seqlens(ids)[0].tolist() for ids in segments]
    results = []
    for given in (bounds, None):
        leaf = x.clone().requires_grad_()
        out = encoder.decoder(leaf, attention_mask=segments, rotary_pos_emb=rot, packed_seq_params=given)
        out.square().mean().backward()
        results.append((out.detach(), leaf.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="only SegmentBounds"):
        from megatron.core.packed_seq_params import PackedSeqParams

        encoder.decoder(x, attention_mask=segments, rotary_pos_emb=rot, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length flash path runs on CUDA")
@pytest.mark.parametrize("row", [FULL, WINDOW])
@pytest.mark.parametrize("batch, heads, groups", [(1, 2, 2), (2, 4, 2)])
def test_varlen_path_equals_masked_path_on_cuda(megatron_world, row, batch, heads, groups):
    segments, _ = encoder_segments(GRIDS)
    segments = segments.cuda()
    s = segments.shape[1]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, batch, n, 16, generator=g).cuda().bfloat16().requires_grad_()
              for n in (heads, groups, groups)]
    grad_out = torch.randn(s, batch, heads * 16, generator=g).cuda().bfloat16()
    module = attention(megatron_world, heads, groups, row, device="cuda")
    got = module(*inputs, segments)
    got.backward(grad_out)
    got_grads = [t.grad for t in inputs]
    reference_inputs = [t.detach().float().requires_grad_() for t in inputs]
    expected = module._masked(*reference_inputs, segments[row], dropout=0.0)  # fp32 masked path
    expected.backward(grad_out.float())
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    for got_grad, ref in zip(got_grads, reference_inputs):
        torch.testing.assert_close(got_grad.float(), ref.grad, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length flash path runs on CUDA")
def test_encoder_on_cuda_matches_the_fp32_masked_encoder(megatron_world):
    """The whole tiny Qwen2.5 ViT (megatron layers: strided q/k/v views, 2D RoPE, window and full
    layers) in bf16 on CUDA (flash varlen) against the same weights in fp32 on CPU (masked SDPA)."""
    from megatron.core.transformer import TransformerConfig

    from loongforge.vlm.encoders import build_encoder
    from loongforge.vlm.encoders.layers import encoder_transformer_config
    from loongforge.vlm.encoders.qwen2_5_vit import QwenViTConfig

    cfg = QwenViTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                        window_size=WINDOW_UNITS * MERGE * 8, full_attention_layers=[1])
    foundation = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    reference, fast = (build_encoder(cfg, encoder_transformer_config(cfg, 1, "none", foundation), megatron_world.pgs)
                       for _ in range(2))
    fast.load_state_dict(reference.state_dict())
    fast.cuda().bfloat16()
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(sum(geometry.patch_counts(GRIDS)), cfg.patch_dim, generator=g)
    expected = reference(pixels, GRIDS)
    got = fast(pixels.cuda(), GRIDS.cuda())
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float().cpu(), expected.detach(), atol=3e-2, rtol=3e-2)
    got.float().square().mean().backward()
    expected.square().mean().backward()
    torch.testing.assert_close(fast.patch_embed.weight.grad.float().cpu(), reference.patch_embed.weight.grad,
                               atol=5e-4, rtol=5e-2)
