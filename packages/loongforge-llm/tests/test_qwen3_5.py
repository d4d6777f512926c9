"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers' own ``Qwen3_5ForCausalLM``.

A tiny random transformers model (4 layers: DeltaNet, DeltaNet, DeltaNet, gated attention;
GQA 4/2 with head dim 32, partial RoPE, DeltaNet with 2 key / 4 value heads) converts to a
LoongForge checkpoint whose logits and loss equal transformers' (fp32); export gives back the HF
state dict bit for bit; the same for Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``: 4 experts, top-2, a gated shared
expert). Packed rows give each sample the loss and gradients it has alone (no
leak across ``cu_seqlens``), and bad ``cu_seqlens`` are refused by name.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from loongforge.core.hf_mapping import MappingError
from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight random, so each mapping shows in the logits (A_log/dt_bias in their working range)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if name.endswith(("A_log", "dt_bias")) else 0.1
            p.copy_(scale * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))


def tiny_hf(seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, attn_implementation="eager"))
    randomize(model, seed)
    return model.eval()


def tensors_of(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def ctx():
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel()
    yield ctx
    destroy_parallel()


def our_trainer(ctx, model_config, run_dir, **train):
    from loongforge.core.training.loop import Trainer
    from loongforge.core.training.schema import LogConfig, SequenceTrainConfig
    from loongforge.llm.recipe import LLMConfig, LLMTask

    train = SequenceTrainConfig(**{"steps": 1, "warmup_steps": 0, "global_batch_size": 1, "micro_batch_size": 1, **train})
    cfg = LLMConfig(model=model_config, train=train, log=LogConfig(run_dir=str(run_dir), tensorboard=False, progress=False))
    return Trainer(LLMTask(cfg), ctx, cfg)


@pytest.fixture(scope="module")
def converted(ctx, tmp_path_factory):
    """(transformers model, its HF dir, our trainer with the converted weights loaded)."""
    from loongforge.core.training import checkpointing

    work = tmp_path_factory.mktemp("qwen3_5")
    hf = tiny_hf()
    hf.save_pretrained(work / "hf")
    done = hf_to_lf(work / "hf", work / "lf", progress=False)
    assert done.family == "qwen3_5"
    trainer = our_trainer(ctx, done.model_config, work / "run")
    checkpointing.load_weights(trainer, work / "lf")
    return hf, work, trainer


def batch(seed: int = 1, b: int = 2, s: int = 24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g), torch.arange(s).expand(b, s)


def test_layer_kinds_follow_the_hf_config(converted):
    from loongforge.llm.layers.gated_delta_net import GatedDeltaNet

    hf, _, trainer = converted
    ours = [isinstance(layer.self_attention, GatedDeltaNet) for layer in trainer.model.module.decoder.layers]
    assert ours == [kind == "linear_attention" for kind in hf.config.layer_types] == [True, True, True, False]


def test_logits_and_loss_match_transformers(converted):
    hf, _, trainer = converted
    tokens, pos = batch()
    labels = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        ours = trainer.model(tokens, pos, None)
        ref = hf(input_ids=tokens, position_ids=pos).logits
        our_loss = trainer.model(tokens, pos, None, labels=labels)  # [b, s] per-token loss
    assert ref.std() > 0.1
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    ref_loss = F.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view_as(our_loss)
    torch.testing.assert_close(our_loss, ref_loss, atol=2e-5, rtol=0)


def test_export_gives_back_the_hf_state_dict(converted):
    hf, work, _ = converted
    back = lf_to_hf(work / "lf", work / "back", progress=False).path
    a, b = tensors_of(work / "hf"), tensors_of(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ref = {k: v for k, v in hf.state_dict().items()}
    for name, tensor in b.items():
        assert torch.equal(ref[name], tensor), name


def test_unsupported_layer_pattern_is_refused_by_key(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, layer_types=types)).save_pretrained(tmp_path / "hf")
    with pytest.raises(MappingError, match="layer_types=.*every n-th layer full attention"):
        hf_to_lf(tmp_path / "hf", tmp_path / "lf", progress=False)


def _packed(cu: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor(cu, dtype=torch.int32)
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def test_packed_samples_do_not_leak(converted):
    """Two samples packed in one row (``cu_seqlens``) give each the per-token loss and the gradients
    it gives alone: the DeltaNet state and convolution restart at the bound, attention stays inside."""
    _, _, trainer = converted
    model = trainer.model
    lengths = (10, 14)
    tokens, _ = batch(seed=3, b=1, s=sum(lengths))
    labels = torch.roll(tokens, -1, dims=1)
    samples = [(tokens[:, :10], labels[:, :10]), (tokens[:, 10:], labels[:, 10:])]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]

    alone_loss, alone_grads = [], []
    for t, y in samples:
        model.zero_grad_buffer()
        loss = model(t, torch.arange(t.shape[1])[None], None, labels=y)
        loss.sum().backward()
        alone_loss.append(loss.detach())
        alone_grads.append(_grads(model))

    for which in range(2):  # each sample's loss in the packed row: its gradients alone
        model.zero_grad_buffer()
        loss = model(tokens, pos, None, labels=labels, packed_seq_params=_packed([0, 10, 24]))
        torch.testing.assert_close(loss.detach(), torch.cat(alone_loss, dim=1), atol=2e-5, rtol=0)
        (loss[:, :10] if which == 0 else loss[:, 10:]).sum().backward()
        got = _grads(model)
        assert any(g.abs().max() > 0 for g in got.values())
        for name, g in got.items():
            torch.testing.assert_close(g, alone_grads[which][name], atol=1e-4, rtol=1e-3,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("cu", [[0, 10, 30], [0, 14, 10, 24], [3, 24], [0]])
def test_invalid_cu_seqlens_are_refused_by_name(converted, cu):
    _, _, trainer = converted
    tokens, _ = batch(seed=3, b=1, s=24)
    with pytest.raises(ValueError, match=r"cu_seqlens_q=\[.*must rise from 0 to the packed row's 24 tokens"):
        trainer.model(tokens, torch.arange(24)[None], None, packed_seq_params=_packed_raw(cu))


def _packed_raw(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=24, max_seqlen_kv=24)


MOE = dict(SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)


def test_moe_import_matches_transformers_and_exports_back(ctx, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from loongforge.core.training import checkpointing

    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE, attn_implementation="eager"))
    randomize(hf, seed=0)
    hf.eval().save_pretrained(tmp_path / "hf")
    done = hf_to_lf(tmp_path / "hf", tmp_path / "lf", progress=False)
    assert done.family == "qwen3_5_moe"
    assert done.model_config.moe_shared_expert_ffn_hidden_size == 48 and done.model_config.moe_shared_expert_gate
    trainer = our_trainer(ctx, done.model_config, tmp_path / "run")
    checkpointing.load_weights(trainer, tmp_path / "lf")
    tokens, pos = batch(seed=4)
    with torch.no_grad():
        ours = trainer.model(tokens, pos, None)
        ref = hf(input_ids=tokens, position_ids=pos).logits
    assert ref.std() > 0.1 and ours.shape[-1] == VOCAB
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)

    back = lf_to_hf(tmp_path / "lf", tmp_path / "back", progress=False).path
    a, b = tensors_of(tmp_path / "hf"), tensors_of(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_meta_build_matches_analytic_counts(family):
    """The debug flavours built on the meta device have the parameters ``parameter_counts`` gives
    (what ``lf-llm info`` and the MFU's FLOPs use)."""
    from loongforge.core.models import get_model_spec
    from loongforge.llm.families.gpt import MODEL_CONFIG_DIR
    from loongforge.core.config import load_config
    from loongforge.llm.sizing import meta_parameters

    spec = get_model_spec(family)
    cfg = load_config(spec.config_class, spec.flavour("debug"), config_dirs=[MODEL_CONFIG_DIR])
    params = meta_parameters(cfg)
    counts = cfg.parameter_counts()
    assert sum(p.numel for p in params) == sum(counts.values())
    assert sum(p.numel for p in params if p.part == "embedding") == counts["embedding"]
    assert cfg.flops_per_token(128) > 6 * sum(counts.values()) - 6 * counts["embedding"] - 6 * counts.get("experts", 0)


def test_gated_delta_rule_matches_transformers_recurrence():
    """The op's chunked reference against transformers' token-by-token recurrence
    (``torch_recurrent_gated_delta_rule``), per packed sequence (the state restarting at each bound,
    from its own initial state), outputs, final states and gradients; 150 tokens span 3 chunks."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from loongforge.llm.ops.gated_delta_rule import gated_delta_rule

    g_ = torch.Generator().manual_seed(5)
    bounds = [0, 70, 71, 150]
    t, hk, hv, dk, dv = 150, 2, 4, 8, 6
    leaves = [torch.randn(1, t, hk, dk, generator=g_), torch.randn(1, t, hk, dk, generator=g_),
              torch.randn(1, t, hv, dv, generator=g_), -torch.rand(1, t, hv, generator=g_),
              torch.rand(1, t, hv, generator=g_), torch.randn(3, hv, dk, dv, generator=g_)]
    leaves = [x.requires_grad_() for x in leaves]
    q, k, v, g, beta, h0 = leaves
    out, final = gated_delta_rule(q, k, v, g, beta, torch.tensor(bounds), h0)
    (out.square().sum() + final.square().sum()).backward()
    ours = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    refs, finals = [], []
    for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
        o, f = torch_recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                                initial_state=h0[i : i + 1], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        refs.append(o)
        finals.append(f)
    ref, ref_final = torch.cat(refs, dim=1), torch.cat(finals)
    (ref.square().sum() + ref_final.square().sum()).backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
    for name, mine, x in zip("q k v g beta h0".split(), ours, leaves):
        torch.testing.assert_close(mine, x.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_zero_centred_norm_scales_in_fp32_as_transformers_in_bf16():
    """With bf16 weights, ``1 + weight`` is formed in fp32 as transformers' Qwen3.5 norm forms it:
    a small weight (0.003) still scales the rows (in bf16, 1.003 would round to 1.0)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from loongforge.llm.layers.norm import ZeroCenteredRMSNorm

    torch.manual_seed(0)
    hidden = 256
    config = SimpleNamespace(normalization="RMSNorm", params_dtype=torch.bfloat16, sequence_parallel=False)
    ours = ZeroCenteredRMSNorm(config, hidden, eps=1e-6)
    theirs = Qwen3_5RMSNorm(hidden, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.fill_(0.003)
        theirs.weight.fill_(0.003)
    x = torch.randn(64, hidden, dtype=torch.bfloat16)
    got, want = ours(x).float(), theirs(x).float()
    gain = float((got * want).sum() / (want * want).sum())
    assert abs(gain - 1.0) < 5e-4, gain  # a bf16 scale of exactly 1.0 gives 0.997
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)
