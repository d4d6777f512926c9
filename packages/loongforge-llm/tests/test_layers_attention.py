"""SDPAttention (core attention on SDPA) vs megatron's local DotProductAttention, fp32 on CPU,
for dense causal batches with GQA and for THD-packed sequences vs each sequence on its own."""

from __future__ import annotations

import pytest
import torch

from loongforge.llm.model_config import GPTConfig

TIGHT = dict(rtol=1e-5, atol=1e-5)
HEADS, GROUPS, HEAD_DIM = 4, 2, 16


def _config():
    from megatron.core.transformer import TransformerConfig

    cfg = GPTConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS)
    return TransformerConfig(**cfg.transformer_config_kwargs(), params_dtype=torch.float32, use_cpu_initialization=True)


def _modules(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from loongforge.llm.layers.attention import SDPAttention

    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return SDPAttention(**args), DotProductAttention(**args)


def _qkv(tokens_shape, generator):
    shapes = [(*tokens_shape, HEADS, HEAD_DIM), (*tokens_shape, GROUPS, HEAD_DIM), (*tokens_shape, GROUPS, HEAD_DIM)]
    return [torch.randn(s, generator=generator, dtype=torch.float32) for s in shapes]


def _run(module, qkv, grad, **kwargs):
    leaves = [t.clone().requires_grad_(True) for t in qkv]
    out = module(*leaves, None, **kwargs)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def test_dense_causal_gqa_matches_megatron_local_attention(megatron_world):
    ours, local = _modules(_config())
    g = torch.Generator().manual_seed(0)
    qkv = _qkv((11, 3), g)  # [sq, b, heads, head_dim]
    grad = torch.randn(11, 3, HEADS * HEAD_DIM, generator=g)
    out, grads = _run(ours, qkv, grad)
    out_ref, grads_ref = _run(local, qkv, grad)
    assert out.shape == out_ref.shape == (11, 3, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, out_ref, **TIGHT)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, **TIGHT)


def test_explicit_padding_mask_matches_megatron_local_attention(megatron_world):
    ours, local = _modules(_config())
    g = torch.Generator().manual_seed(1)
    qkv = _qkv((7, 2), g)
    # megatron's convention: True = masked out; causal plus the last two keys of sample 1 hidden
    mask = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, 5:] = True
    mask[1, :, :, 0] = False
    out = ours(*qkv, mask)
    ref = local(*qkv, mask)
    torch.testing.assert_close(out, ref, **TIGHT)


@pytest.mark.parametrize("lengths", [(5, 1, 9), (16,)])
def test_packed_thd_matches_each_sequence_alone(megatron_world, lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, local = _modules(_config())
    g = torch.Generator().manual_seed(2)
    total = sum(lengths)
    qkv = _qkv((total,), g)  # THD: [t, heads, head_dim]
    grad = torch.randn(total, HEADS * HEAD_DIM, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    out, grads = _run(ours, qkv, grad, packed_seq_params=params)
    assert out.shape == (total, HEADS * HEAD_DIM)

    # reference: megatron's local attention on each sequence as its own batch of one
    leaves = [t.clone().requires_grad_(True) for t in qkv]
    bounds = cu.tolist()
    ref = torch.cat([local(*(x[a:b, None] for x in leaves), None)[:, 0] for a, b in zip(bounds[:-1], bounds[1:])])
    ref.backward(grad)
    torch.testing.assert_close(out, ref.detach(), **TIGHT)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, **TIGHT)


def test_rejects_a_cp_size_without_its_cp_group_and_bad_cu_seqlens(megatron_world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from loongforge.llm.layers.attention import SDPAttention

    config = _config()
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        SDPAttention(config, 1, AttnMaskType.causal, "self")
    ours, _ = _modules(_config())
    qkv = _qkv((6,), torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="must run from 0 to the 6 packed tokens"):
        ours(*qkv, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
