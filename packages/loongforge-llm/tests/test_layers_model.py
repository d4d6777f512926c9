"""The GPT model lf-llm builds (fast layer spec, fused-loss model) vs megatron's GPTModel on its
local spec with the same weights, fp32 on CPU: logits, per-token loss and every gradient, with the
torch reference ops and with the Triton kernels under the interpreter; THD-packed sequences vs
each sequence unpacked; recomputing the elementwise activations gives the same gradients."""

from __future__ import annotations

import pytest
import torch

from loongforge.llm.families.gpt import layer_spec, transformer_config_kwargs
from loongforge.llm.model_config import GPTConfig

CFG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=256, max_position_embeddings=64)
TOL = dict(rtol=1e-4, atol=1e-5)


def _gpt(spec, cfg=CFG, model_class=None, **config_overrides):
    from megatron.core.transformer import TransformerConfig

    from loongforge.llm.layers.gpt_model import FusedLossGPTModel

    config = TransformerConfig(**{**transformer_config_kwargs(cfg), **config_overrides},
                               params_dtype=torch.float32, use_cpu_initialization=True)
    return (model_class or FusedLossGPTModel)(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=cfg.tie_embeddings)


def _local_spec(cfg=CFG):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")


def _pair(cfg=CFG, **config_overrides):
    torch.manual_seed(0)
    from megatron.core.models.gpt import GPTModel

    ref = _gpt(_local_spec(cfg), cfg, GPTModel, **config_overrides)
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
    _check_against_local_spec(cfg)


class _TritonCapableCpu:
    """The cpu accelerator, claiming Triton: the registry then hands out the Triton kernels,
    which run under the interpreter (the root conftest sets TRITON_INTERPRET=1)."""

    def __init__(self, base):
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)

    def supports_triton(self) -> bool:
        return True


def test_triton_kernels_in_the_model_match_megatron_local_spec(megatron_world, monkeypatch):
    pytest.importorskip("loongforge.kernels")
    import loongforge.core.accelerators as accelerators

    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    cpu = accelerators.get_accelerator()
    monkeypatch.setattr(accelerators, "get_accelerator", lambda *a, **k: _TritonCapableCpu(cpu))
    ours = _check_against_local_spec(CFG)
    assert ours.decoder.layers[0].mlp._swiglu.__module__ == "loongforge.kernels.provider"  # not the reference


def test_recompute_elementwise_changes_nothing(megatron_world):
    from loongforge.llm.layers.spec import fast_layer_spec

    torch.manual_seed(0)
    keep = _gpt(fast_layer_spec(CFG, recompute_elementwise=False))
    recompute = _gpt(fast_layer_spec(CFG, recompute_elementwise=True))
    recompute.load_state_dict(keep.state_dict())
    tokens, labels, pos = _batch(2, 9)
    for model in (keep, recompute):
        model(tokens, pos, None, labels=labels).sum().backward()
    got, want = _grads(recompute), _grads(keep)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL)


def _check_against_local_spec(cfg):
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
    return ours


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


def test_kernels_force_reference_config_key_builds_reference_ops(megatron_world, monkeypatch):
    pytest.importorskip("loongforge.kernels")
    import os

    import loongforge.core.accelerators as accelerators
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.kernels import REFERENCE_OPS
    from loongforge.llm.recipe import LLMTask, load_llm_config

    monkeypatch.setenv("LOONGFORGE_KERNELS", "auto")  # restored after the test
    cpu = accelerators.get_accelerator()
    monkeypatch.setattr(accelerators, "get_accelerator", lambda *a, **k: _TritonCapableCpu(cpu))
    task = LLMTask(load_llm_config("train_debug", ["kernels.force_reference=true"]))
    config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32, use_cpu_initialization=True)
    model = task.build_model(megatron_world, config, True, True)
    assert os.environ["LOONGFORGE_KERNELS"] == "reference"
    layer = model.decoder.layers[0]
    assert layer.mlp._swiglu is REFERENCE_OPS["swiglu"]
    assert layer.input_layernorm._rms_norm is REFERENCE_OPS["rms_norm"]
    assert model._linear_cross_entropy is REFERENCE_OPS["linear_cross_entropy"]


def test_build_kwargs_reach_the_family_build(megatron_world):
    """``LLMTask.build_kwargs`` goes to the family's build: ``lf-llm bench``'s
    ``spec.recompute_elementwise=false`` builds fast layers that keep their elementwise outputs
    (even where Transformer Engine is installed; without it the default layers recompute them)."""
    import importlib.util

    from megatron.core.transformer import TransformerConfig

    from loongforge.llm.recipe import LLMTask, load_llm_config

    class KeepElementwise(LLMTask):
        def build_kwargs(self):
            return {"recompute_elementwise": False}

    def recomputes(task):
        config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32,
                                   use_cpu_initialization=True)
        model = task.build_model(megatron_world, config, True, True)
        return [layer.recompute_elementwise for layer in model.decoder.layers]

    cfg = load_llm_config("train_debug")
    assert recomputes(KeepElementwise(cfg)) == [False] * cfg.model.num_layers
    if importlib.util.find_spec("transformer_engine") is None:
        assert recomputes(LLMTask(cfg)) == [True] * cfg.model.num_layers
