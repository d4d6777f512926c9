"""The GPT model lf-llm builds (fast layer spec, fused-loss model) vs megatron's GPTModel on its
local spec with the same weights, fp32 on CPU: logits, per-token loss and every gradient, with the
torch reference ops and with the Triton kernels under the interpreter; THD-packed sequences vs
each sequence unpacked; recomputing the elementwise activations gives the same gradients."""

from __future__ import annotations

import pytest
import torch
from host_reads import counted_reads
from triton_capable import TritonCapable

from loongforge.llm.families.gpt import layer_spec
from loongforge.llm.model_config import GPTConfig

CFG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=256, max_position_embeddings=64)
TOL = dict(rtol=1e-4, atol=1e-5)


def _gpt(spec, cfg=CFG, model_class=None, **config_overrides):
    from megatron.core.transformer import TransformerConfig

    from loongforge.llm.layers.gpt_model import FusedLossGPTModel

    config = TransformerConfig(**{**cfg.transformer_config_kwargs(), **config_overrides},
                               params_dtype=torch.float32, use_cpu_initialization=True)
    return (model_class or FusedLossGPTModel)(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(cfg.rotary_base), rotary_percent=cfg.rotary_percent,
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


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk-norm"])
def test_triton_kernels_in_the_model_match_megatron_local_spec(megatron_world, monkeypatch, qk_norm):
    pytest.importorskip("loongforge.kernels")
    import loongforge.core.accelerators as accelerators

    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    cpu = accelerators.get_accelerator()
    monkeypatch.setattr(accelerators, "get_accelerator", lambda *a, **k: TritonCapable(cpu))
    calls = []
    if qk_norm:  # Qwen3's q/k norms: the grouped QKV op normalises the heads in its pass
        import loongforge.kernels.grouped_qkv_rope as gq

        fused = gq.grouped_qkv_norm_rope
        monkeypatch.setattr(gq, "grouped_qkv_norm_rope", lambda *a: calls.append(1) or fused(*a))
    ours = _check_against_local_spec(GPTConfig(**{**CFG.__dict__, "qk_layernorm": qk_norm}))
    assert ours.decoder.layers[0].mlp._swiglu.__module__ == "loongforge.kernels.provider"  # not the reference
    assert len(calls) == (2 * CFG.num_layers if qk_norm else 0)  # the logits' forward and the loss's


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


def test_recomputed_inputs_handed_to_the_main_grad_linears_change_nothing(megatron_world, monkeypatch):
    """Inside the engine's schedule (``main_grad_fusion``) the linears after the recomputed norms and
    SwiGLU take their inputs over from ``DiscardedOutput`` (saving nothing of them): every weight
    gradient in ``main_grad`` equals the run that keeps the outputs."""
    from loongforge.core.training.main_grad import main_grad_fusion
    from loongforge.llm.layers.discarded_output import DiscardedOutput
    from loongforge.llm.layers.spec import fast_layer_spec

    claims = []
    claim = DiscardedOutput.claim
    monkeypatch.setattr(DiscardedOutput, "claim", lambda self, x: claims.append(claim(self, x)) or claims[-1])
    torch.manual_seed(0)
    keep = _gpt(fast_layer_spec(CFG, recompute_elementwise=False))
    recompute = _gpt(fast_layer_spec(CFG, recompute_elementwise=True))
    recompute.load_state_dict(keep.state_dict())
    tokens, labels, pos = _batch(2, 9)
    grads = []
    for model in (keep, recompute):
        for p in model.parameters():  # megatron DDP's gradient buffer, as the engine gives it
            p.main_grad = torch.zeros_like(p)
            p.grad_added_to_main_grad = False
        with main_grad_fusion():
            model(tokens, pos, None, labels=labels).sum().backward()
        grads.append({n: p.main_grad + (p.grad if p.grad is not None and not p.grad_added_to_main_grad else 0)
                      for n, p in model.named_parameters()})
    assert claims == [True] * (3 * CFG.num_layers)  # the QKV, fc1 and fc2 linears of every layer took theirs
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


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
    unpacked = _each_sequence_alone(ref, tokens, labels, cu.tolist())
    unpacked.sum().backward()
    torch.testing.assert_close(packed, unpacked, **TOL)
    got, want = _grads(ours), _grads(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _each_sequence_alone(ref, tokens, labels, bounds):
    """The per-token loss of megatron's local spec on each packed sequence (``bounds``) as its own
    batch of one (dense causal attention), concatenated as the packed row."""
    pieces = [ref(tokens[:, a:b], torch.arange(b - a)[None], None, labels=labels[:, a:b])
              for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=1)


def test_packed_bounds_are_read_once_per_forward_for_all_layers(megatron_world):
    """Two forwards of THD rows as lf-llm's data hands them (``packed_seq_params``), equally long
    but cut differently, through two layers: each matches its sequences run alone, and the
    bounds are read back once per forward (``tolist`` of the first layer, shared by the second)."""
    from loongforge.llm.data.packing import packed_seq_params

    ours, ref = _pair()
    assert len(ours.decoder.layers) == 2
    for bounds in ([0, 7, 10, 22], [0, 12, 22]):
        tokens, labels, _ = _batch(1, 22, seed=3)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
        reads = []
        cu = counted_reads(torch.tensor(bounds, dtype=torch.int32), reads)
        params = packed_seq_params({"cu_seqlens": cu, "max_seqlen": 12})
        with torch.no_grad():
            packed = ours(tokens, pos, None, labels=labels, packed_seq_params=params)
            assert reads == ["tolist"]
            torch.testing.assert_close(packed, _each_sequence_alone(ref, tokens, labels, bounds), **TOL)


def test_models_of_different_rope_keep_their_own_tables(megatron_world):
    """Two models of different RoPE (base and rotary dims), one's forward run between the layers of
    the other's: each matches megatron's local spec of its own RoPE (a cache keyed by the angle
    tensor's identity passes this part either way), and each model's attention layers share one
    RoPE table cache that is not the other model's (the part a process-wide cache fails)."""
    other = GPTConfig(**{**CFG.__dict__, "rotary_base": 500.0, "rotary_percent": 0.5})
    (a, ref_a), (b, ref_b) = _pair(), _pair(other)  # the same weights: only the RoPE differs
    tokens, _, pos = _batch(2, 11)
    with torch.no_grad():
        want_a, want_b = ref_a(tokens, pos, None), ref_b(tokens, pos, None)
        assert not torch.allclose(want_a, want_b, **TOL)  # the two RoPEs give different logits
        inner = []
        hook = a.decoder.layers[0].register_forward_hook(lambda *_: inner.append(b(tokens, pos, None)))
        try:
            got_a = a(tokens, pos, None)
        finally:
            hook.remove()
        torch.testing.assert_close(got_a, want_a, **TOL)
        torch.testing.assert_close(inner[0], want_b, **TOL)
        torch.testing.assert_close(b(tokens, pos, None), want_b, **TOL)
    tables = [{id(layer.self_attention.rope_tables) for layer in m.decoder.layers} for m in (a, b)]
    assert len(tables[0]) == len(tables[1]) == 1 and tables[0] != tables[1]


def test_kernels_force_reference_config_key_applies_to_its_model_only(megatron_world, monkeypatch):
    """``kernels.force_reference=true`` reaches the modules of the model built with it through the
    build context (``ctx.kernels``), not through the environment: a model built afterwards in the
    same process, with the same context and the default setting, gets the Triton kernels (run
    under the interpreter here, on an accelerator that claims Triton)."""
    pytest.importorskip("loongforge.kernels")
    import dataclasses
    import os

    from megatron.core.transformer import TransformerConfig

    from loongforge.core.kernels import KernelPolicy, get_op
    from loongforge.kernels import provider
    from loongforge.llm.recipe import LLMTask, load_llm_config

    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)  # restored after the test
    triton_capable = KernelPolicy(accelerator=TritonCapable(megatron_world.accelerator))
    ctx = dataclasses.replace(megatron_world, kernels=triton_capable)

    def ops(overrides: list[str]) -> dict:
        task = LLMTask(load_llm_config("train_debug", overrides))
        config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32,
                                   use_cpu_initialization=True)
        model = task.build_model(ctx, config, True, True)
        layer = model.decoder.layers[0]
        return {"swiglu": layer.mlp._swiglu, "rms_norm": layer.input_layernorm._rms_norm,
                "rms_norm_with_residual": layer.input_layernorm._rms_norm_with_residual,
                "embedding_grad_add": model.embedding.word_embeddings.grad_add,
                "add_rms_norm": layer.pre_mlp_layernorm._add_rms_norm, "rope": layer.self_attention._rope,
                "linear_cross_entropy": model._linear_cross_entropy}

    forced = ops(["kernels.force_reference=true"])
    after = ops([])
    assert "LOONGFORGE_KERNELS" not in os.environ
    for name in forced:
        assert forced[name] is get_op(name).reference, name
        assert after[name] is getattr(provider, name), name


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
