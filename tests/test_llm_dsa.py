"""DeepSeek-V3.2 sparse attention (``model.attention_variant: dsa``) on megatron-core's DSA modules.

References: the plain MLA model with the same weights (an indexer that keeps every key must give
its logits: sparse attention then is MLA, in megatron's absorbed form), and, for the sparse
model, the same model with the indexer loss off (its gradients must be the language-model
gradients exactly: the indexer reads detached activations and learns from its own loss only).
"""

import dataclasses
import json

import pytest
import torch
from cli_runner import run_cli
from triton_capable import TritonCapable

from loongforge.core.config import ConfigError
from loongforge.llm.families import deepseek_v3
from loongforge.llm.moe_config import MLAMoEConfig
from loongforge.llm.recipe import load_llm_config

SEQ = 24
VOCAB = 4096


@pytest.fixture(scope="module")
def ctx():
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(seed=0)
    yield ctx
    destroy_parallel()


def build(ctx, cfg: MLAMoEConfig, seed: int) -> torch.nn.Module:
    from megatron.core.transformer import TransformerConfig

    from loongforge.llm.families.moe import build_moe_gpt

    torch.manual_seed(seed)
    config = TransformerConfig(**cfg.transformer_config_kwargs(), use_cpu_initialization=True,
                               params_dtype=torch.float32, calculate_per_token_loss=True)
    return build_moe_gpt(cfg, ctx, config, True, True)


def tokens(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ)


def v32(**changes) -> MLAMoEConfig:
    return dataclasses.replace(deepseek_v3.flavour("v3.2-debug"), **changes)


def is_indexer(name: str) -> bool:
    return ".core_attention.indexer." in name


def test_meta_build_and_info_count_the_indexer(capsys):
    from loongforge.llm.cli import main
    from loongforge.llm.sizing import meta_parameters

    cfg = deepseek_v3.flavour("v3.2-debug")
    params = meta_parameters(cfg)
    counts = cfg.parameter_counts()
    assert counts["indexer"] > 0
    assert sum(p.numel for p in params) == sum(counts.values())
    assert sum(p.numel for p in params if is_indexer(p.name)) == counts["indexer"]
    assert not any(p.tensor_parallel for p in params if is_indexer(p.name))  # duplicated over TP

    assert main(["info", "--config", "train_deepseek_v3_2_debug"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"] == counts
    assert out["total_parameters"] == sum(counts.values())
    mla = dataclasses.replace(cfg, attention_variant="mla")
    assert cfg.activated_parameter_count() == mla.activated_parameter_count() + counts["indexer"]


def test_real_size_flavour():
    d = deepseek_v3.flavour("v3.2-671b")
    v3 = deepseek_v3.flavour("671b")
    assert (d.dsa_indexer_n_heads, d.dsa_indexer_head_dim, d.dsa_indexer_topk) == (64, 128, 2048)
    assert dataclasses.replace(d, attention_variant="mla") == dataclasses.replace(
        v3, dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=2048)  # DeepSeek-V3's architecture
    # 61 indexers of 1536x(64x128) + 7168x128 + 7168x64 weights and a 128-wide LayerNorm: 0.85B
    assert d.parameter_counts()["indexer"] / 1e9 == pytest.approx(0.852, abs=0.001)
    # at 128K tokens, 2048 keys per query (plus the indexer's scores) cost less than all of them
    assert d.flops_per_token(131072) < v3.flops_per_token(131072)


def test_balancer_plans_dsa_with_every_query_at_its_full_topk():
    """DSA's FLOPs per token are not affine in the length (a sequence's first topk queries see
    fewer keys), which the DP balancer's cost model refuses; it plans with every query at its full
    top-k, whose excess over the exact count is the same k(k-1)/2 missing keys per sequence at
    every length past k. Without DSA the two are the same."""
    from loongforge.core.balance.cost import CostModel

    cfg = v32()
    with pytest.raises(ValueError, match="not affine"):
        CostModel.from_flops_per_token(cfg.flops_per_token)
    assert CostModel.from_flops_per_token(cfg.balance_flops_per_token).a > 0  # the indexer scores every key
    excess = [(cfg.balance_flops_per_token(n) - cfg.flops_per_token(n)) * n for n in (64, 1024, 16384)]
    assert excess[0] > 0 and excess == pytest.approx([excess[0]] * 3, rel=1e-9)
    plain = deepseek_v3.flavour("debug")
    assert plain.balance_flops_per_token(1024) == plain.flops_per_token(1024)


@pytest.mark.parametrize("changes,match", [
    (dict(attention_variant="nsa"), "model.attention_variant='nsa': one of mla, dsa"),
    (dict(dsa_indexer_topk=0), "model.dsa_indexer_topk=0: must be >= 1"),
    (dict(dsa_indexer_n_heads=0), "model.dsa_indexer_n_heads=0: must be >= 1"),
    (dict(dsa_indexer_head_dim=8), "model.dsa_indexer_head_dim=8 must exceed model.qk_rope_head_dim=8"),
    (dict(dsa_indexer_loss_coeff=-1.0), "model.dsa_indexer_loss_coeff=-1.0: must be >= 0"),
])
def test_bad_indexer_config_names_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        MLAMoEConfig(**{"attention_variant": "dsa", **changes})


def test_dsa_is_refused_outside_multi_latent_attention():
    with pytest.raises(ConfigError, match="model.attention_variant"):
        load_llm_config("train_qwen3_moe_debug", ["model.attention_variant=dsa"])
    with pytest.raises(ConfigError, match="model.dsa_indexer_topk=0"):
        load_llm_config("train_deepseek_v3_2_debug", ["model.dsa_indexer_topk=0"])


def test_indexer_keeping_every_key_gives_the_mla_logits(ctx):
    mla = build(ctx, v32(attention_variant="mla"), seed=0)
    dsa = build(ctx, v32(dsa_indexer_topk=SEQ), seed=1)
    result = dsa.load_state_dict(mla.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(is_indexer(k) for k in result.missing_keys)  # the indexer is extra
    tok, pos = tokens()
    for mode in ("eval", "train"):  # train: the indexer loss is attached, the forward unchanged
        mla.train(mode == "train")
        dsa.train(mode == "train")
        with torch.no_grad():
            want, got = mla(tok, pos, None), dsa(tok, pos, None)
        assert want.shape == (2, SEQ, VOCAB)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def grads(model, tok, pos) -> dict[str, torch.Tensor | None]:
    model.train()
    model.zero_grad()
    model(tok, pos, None, labels=tok).float().sum().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_sparse_attention_changes_logits_and_the_indexer_learns(ctx):
    topk = 6
    dense = build(ctx, v32(dsa_indexer_topk=SEQ), seed=1)
    sparse = build(ctx, v32(dsa_indexer_topk=topk), seed=2)
    sparse.load_state_dict(dense.state_dict())
    tok, pos = tokens()
    dense.eval()
    sparse.eval()
    with torch.no_grad():
        want, got = dense(tok, pos, None), sparse(tok, pos, None)
    # the first topk queries have at most topk keys: nothing to drop; every later one drops some
    torch.testing.assert_close(got[:, :topk], want[:, :topk], rtol=1e-5, atol=1e-5)
    assert (got[:, topk:] - want[:, topk:]).abs().amax(dim=-1).min() > 1e-4

    with_loss = grads(sparse, tok, pos)
    indexer = {n: g for n, g in with_loss.items() if is_indexer(n)}
    assert len(indexer) == 2 * 5  # per layer: wq_b, wk, k_norm weight and bias, weights_proj
    assert all(g is not None and g.abs().sum() > 0 for g in indexer.values())

    no_loss = build(ctx, v32(dsa_indexer_topk=topk, dsa_indexer_loss_coeff=0.0), seed=2)
    no_loss.load_state_dict(sparse.state_dict())
    without = grads(no_loss, tok, pos)
    assert all(without[n] is None or not without[n].any() for n in indexer)
    for name, g in with_loss.items():
        if not is_indexer(name):
            torch.testing.assert_close(g, without[name], rtol=0, atol=0, msg=name)


def assert_registry_equals_megatron(core, seen: dict, shape: tuple) -> None:
    """RegistryDSAttention's forward against megatron's DSAttention forward on the inputs ``seen``
    (the core attention's args and kwargs in a model forward): output, input grads and indexer
    grads (which must be non-zero: the indexer loss trains it)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    from loongforge.llm.families import dsa

    def run(forward):
        core.zero_grad()
        query, key = (t.detach().requires_grad_() for t in seen["args"])
        up_v = seen["kwargs"]["up_v_weight"].detach().requires_grad_()
        out = forward(core, query, key, **{**seen["kwargs"], "up_v_weight": up_v})
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        indexer = {n: p.grad.clone() for n, p in core.indexer.named_parameters()}
        return out, query.grad, key.grad, up_v.grad, indexer

    want, got = run(DSAttention.forward), run(dsa.RegistryDSAttention.forward)
    assert want[0].shape == shape and all(g.abs().sum() > 0 for g in want[4].values())
    for w, g in zip(want[:4], got[:4]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for name, w in want[4].items():
        torch.testing.assert_close(got[4][name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kernel,sparse_loss", [("registry", False), ("registry", True), ("triton", False),
                                                 ("triton", True)])
def test_registry_sparse_attention_equals_megatrons(ctx, kernel, sparse_loss, monkeypatch):
    """RegistryDSAttention (the kernel registry's indexer top-k, indexer loss and sparse MLA;
    ``triton``: loongforge-kernels' Triton kernels, interpreted on CPU, picked by a build context
    whose accelerator claims Triton) against megatron's own DSAttention forward on the same module
    and inputs: output, input grads and indexer grads (indexer loss on, dense and sparse KL)."""
    from loongforge.core.kernels import KernelPolicy
    from loongforge.llm.families import dsa

    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    if kernel == "triton":
        from loongforge.kernels import provider

        ctx = dataclasses.replace(ctx, kernels=KernelPolicy(accelerator=TritonCapable(ctx.accelerator)))
    # 16 indexer heads: a key scores exactly 0 (a tie the two top-k may break differently) only
    # when all 16 ReLU(q.k) are 0
    model = build(ctx, v32(dsa_indexer_topk=6, dsa_indexer_n_heads=16, dsa_indexer_use_sparse_loss=sparse_loss), seed=2)
    model.train()
    core = model.decoder.layers[1].self_attention.core_attention
    assert type(core) is dsa.RegistryDSAttention
    if kernel == "triton":
        assert core._sparse_attention is provider.sparse_mla_attention
    seen = {}
    hook = core.register_forward_pre_hook(lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True)
    tok, pos = tokens()
    model(tok, pos, None)
    hook.remove()

    assert_registry_equals_megatron(core, seen, (SEQ, 2, 4 * 16))

    # the tensor-parallel loss path (megatron's loss on the registry's top-k), here on one rank
    from loongforge.core.kernels.registry import get_kernel

    query, key = seen["args"]
    kw = seen["kwargs"]
    q, k, w = (t.transpose(0, 1) for t in core.indexer.forward_before_topk(kw["x"].detach(), kw["qr"].detach(), None))
    topk = get_kernel("dsa_indexer_topk")(q.detach(), k.detach(), w.detach(), core.index_topk)
    per_query = get_kernel("dsa_indexer_loss")(q, k, w, query.transpose(0, 1).detach(), key[:, :, 0].transpose(0, 1).detach(),
                                              core.softmax_scale, topk if sparse_loss else None)
    tp_loss = core._tensor_parallel_indexer_loss([(0, SEQ, 0, SEQ)], q, k, w, topk, query, key[:, :, 0], None)
    torch.testing.assert_close(tp_loss, per_query.sum(), rtol=1e-5, atol=1e-7)
    assert tp_loss > 0


@pytest.mark.parametrize("sparse_loss", [False, True], ids=["dense-loss", "sparse-loss"])
def test_registry_sparse_attention_on_packed_rows_equals_megatrons(ctx, sparse_loss):
    """Packed (THD) rows: three sequences of 10, 16 and 6 tokens in one row of 32 (cu_seqlens),
    each attending only within itself. RegistryDSAttention (one piece per sequence, its top-k and
    indexer loss over that sequence's keys only) against megatron's DSAttention forward, which
    masks by cu_seqlens: output, input grads and indexer grads."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = build(ctx, v32(dsa_indexer_topk=6, dsa_indexer_n_heads=16, dsa_indexer_use_sparse_loss=sparse_loss), seed=2)
    model.train()
    core = model.decoder.layers[1].self_attention.core_attention
    seen = {}
    hook = core.register_forward_pre_hook(lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True)
    lengths = [10, 16, 6]
    cu = torch.tensor([0, 10, 26, 32], dtype=torch.int32)
    row = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)
    model(row, torch.cat([torch.arange(n) for n in lengths])[None], None, packed_seq_params=params)
    hook.remove()
    assert seen["args"][0].shape == (32, 4, 24)  # THD: [t, heads, latent + rope]
    assert_registry_equals_megatron(core, seen, (32, 1, 4 * 16))

    # the tensor-parallel loss path (megatron's loss per piece), here on one rank, against the
    # registry's loss on the same pieces: the second sequence in two chunks as under CP (the later
    # one against keys before it), some rows marked as padding
    from loongforge.core.kernels.registry import get_kernel

    kw = seen["kwargs"]
    query, key = (t.unsqueeze(1) for t in seen["args"])
    q, k, w = (t.transpose(0, 1) for t in core.indexer.forward_before_topk(kw["x"], kw["qr"], params))
    pieces = [(0, 10, 0, 10), (10, 18, 10, 18), (18, 26, 10, 26), (26, 32, 26, 32)]
    topk = torch.cat([get_kernel("dsa_indexer_topk")(q[:, t0:t1], k[:, k0:k1], w[:, t0:t1], core.index_topk)
                      for t0, t1, k0, k1 in pieces], 1)
    real = torch.ones(1, 32, dtype=torch.bool)
    real[0, [24, 25, 31]] = False
    per_query = torch.cat([get_kernel("dsa_indexer_loss")(q[:, t0:t1], k[:, k0:k1], w[:, t0:t1],
                                                          query.transpose(0, 1)[:, t0:t1], key[:, :, 0].transpose(0, 1)[:, k0:k1],
                                                          core.softmax_scale, topk[:, t0:t1] if sparse_loss else None)
                           for t0, t1, k0, k1 in pieces], 1)
    tp_loss = core._tensor_parallel_indexer_loss(pieces, q, k, w, topk, query, key[:, :, 0], real)
    torch.testing.assert_close(tp_loss, (per_query * real).sum(), rtol=1e-5, atol=1e-7)
    assert tp_loss > 0 and per_query[~real].abs().sum() > 0  # the padding rows had a loss to leave out


HF_V32 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6,
              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=6,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "original_max_position_embeddings": 32},
              attn_implementation="eager", num_nextn_predict_layers=0)


def test_hf_deepseek_v32_converts_to_the_same_logits(ctx, tmp_path):
    """transformers' DeepSeek-V3.2 (its own indexer and sparse mask) converted with ``hf_to_lf``
    gives its logits, and its top-k selection matters (all keys give other logits)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf
    from loongforge.core.training import checkpointing
    from loongforge.core.training.schema import LogConfig, SequenceTrainConfig
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import LLMConfig, LLMTask

    torch.manual_seed(5)
    hf = DeepseekV32ForCausalLM(DeepseekV32Config(**HF_V32)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm.weight" in name or "layernorm" in name else 0.0) + 0.05 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path / "hf")
    done = hf_to_lf(tmp_path / "hf", tmp_path / "lf", progress=False)
    cfg = done.model_config
    assert (done.family, cfg.attention_variant, cfg.dsa_indexer_topk, cfg.dsa_indexer_n_heads) == ("deepseek_v3", "dsa", 6, 8)
    run = LLMConfig(model=cfg, train=SequenceTrainConfig(steps=1, warmup_steps=0, global_batch_size=1, micro_batch_size=1),
                    log=LogConfig(run_dir=str(tmp_path / "run"), tensorboard=False, progress=False))
    trainer = Trainer(LLMTask(run), ctx, run)
    checkpointing.load_weights(trainer, tmp_path / "lf")
    trainer.model.eval()
    tok, pos = tokens(seed=7)
    with torch.no_grad():
        want, got = hf(input_ids=tok, position_ids=pos).logits, trainer.model(tok, pos, None)
        hf.config.index_topk = SEQ
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = SEQ
        dense = hf(input_ids=tok, position_ids=pos).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (dense - want).abs().max() > 1e-3

    lf_to_hf(tmp_path / "lf", tmp_path / "back", progress=False)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (back["index_n_heads"], back["index_head_dim"], back["index_topk"]) == (8, 16, 6)
    from safetensors.torch import load_file

    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(exported) == sorted(original) and any(".indexer." in n for n in original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())


@pytest.mark.slow
def test_cli_trains_the_debug_model(tmp_path, llm_data_cache):
    proc = run_cli(["lf-llm", "train", "--config", "train_deepseek_v3_2_debug", "train.steps=3", "train.warmup_steps=1",
                    "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=64", "log.interval=1",
                    "log.tensorboard=false", "log.progress=false", "checkpoint.save=false", f"log.run_dir={tmp_path}",
                    f"data.cache_dir={llm_data_cache}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(7.0 < r["loss"] < 9.0 and r["grad_norm"] > 0 for r in records)  # ln(4096) = 8.3 at the start


def test_the_target_chunks_are_the_attention_forwards_chunks():
    """The sparse stage's one-pass indexer target reads the log-sum-exp the fused absorbed attention
    saved: the target's absorbed queries must be made in the same chunks of tokens (the same GEMM
    shapes, so the same bits) as the attention forward's."""
    from loongforge.kernels.sparse_mla_absorbed import CHUNK_ELEMENTS
    from loongforge.llm.families.dsa_attention import TARGET_CHUNK_ELEMENTS

    assert TARGET_CHUNK_ELEMENTS == CHUNK_ELEMENTS
