"""GPT models on LoongForge's layer spec vs megatron's local spec with the same weights, fp32 on
CPU: logits, per-token loss and every gradient; THD-packed sequences vs each one unpacked."""

from __future__ import annotations

import pytest
import torch

from loongforge.llm.families.gpt import layer_spec, transformer_config_kwargs
from loongforge.llm.model_config import GPTConfig

CFG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=256, max_position_embeddings=64)
TOL = dict(rtol=1e-4, atol=1e-5)


def _gpt(spec, cfg=CFG, **config_overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**{**transformer_config_kwargs(cfg), **config_overrides},
                               params_dtype=torch.float32, use_cpu_initialization=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=cfg.tie_embeddings)


def _local_spec(cfg=CFG):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")


def _pair(cfg=CFG, **config_overrides):
    torch.manual_seed(0)
    ref = _gpt(_local_spec(cfg), cfg, **config_overrides)
    ours = _gpt(layer_spec(cfg), cfg, **config_overrides)
    ours.load_state_dict(ref.state_dict(), strict=True)  # same parameter names, same weights
    return ours, ref


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(b, s, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (b, s), generator=g)
    return tokens, labels, torch.arange(s).expand(b, s)


@pytest.mark.parametrize("cfg", [CFG, GPTConfig(**{**CFG.__dict__, "qk_layernorm": True, "add_qkv_bias": True})],
                         ids=["llama", "qkv-bias-qk-norm"])
def test_layer_spec_matches_megatron_local_spec(megatron_world, cfg):
    ours, ref = _pair(cfg)
    tokens, labels, pos = _batch(3, 13)
    logits = ours(tokens, pos, None)
    torch.testing.assert_close(logits, ref(tokens, pos, None), **TOL)
    loss, loss_ref = ours(tokens, pos, None, labels=labels), ref(tokens, pos, None, labels=labels)
    assert loss.shape == (3, 13) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, **TOL)
    weights = torch.rand(3, 13, generator=torch.Generator().manual_seed(2))  # non-uniform per-token grads
    (loss * weights).sum().backward()
    (loss_ref * weights).sum().backward()
    got, want = _grads(ours), _grads(ref)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_thd_matches_unpacked_sequences(megatron_world):
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, ref = _pair()
    lengths = [7, 3, 12]
    tokens, labels, _ = _batch(1, sum(lengths), seed=3)
    cu = torch.tensor([0, 7, 10, 22], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    packed = ours(tokens, pos, None, labels=labels, packed_seq_params=params)
    packed.sum().backward()

    pieces = []  # megatron's local spec, each sequence its own batch of one, dense causal attention
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        pieces.append(ref(tokens[:, a:b], torch.arange(b - a)[None], None, labels=labels[:, a:b]))
    unpacked = torch.cat(pieces, dim=1)
    unpacked.sum().backward()
    torch.testing.assert_close(packed, unpacked, **TOL)
    got, want = _grads(ours), _grads(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
