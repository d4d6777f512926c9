"""The MoE families' configs: validation, schema selection by family, and sizing (meta-device
build vs the analytic counts, per-GPU placement rules, published sizes, ``lf-llm info``)."""

import json

import pytest

from loongforge.core.config import ConfigError
from loongforge.core.parallel import ParallelLayout
from loongforge.llm.families import deepseek_v3, qwen3_moe
from loongforge.llm.moe_config import MLAMoEConfig, MoEConfig
from loongforge.llm.recipe import load_llm_config
from loongforge.llm.sizing import ParameterShape, meta_parameters, per_gpu, size_report


@pytest.mark.parametrize("family", [qwen3_moe, deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_meta_build_matches_analytic_counts(family):
    cfg = family.flavour("debug")
    params = meta_parameters(cfg)
    counts = cfg.parameter_counts()
    assert sum(p.numel for p in params) == sum(counts.values())
    assert sum(p.numel for p in params if p.expert) == counts["experts"]
    assert sum(p.numel for p in params if p.part == "embedding") == counts["embedding"]
    report = size_report(cfg, ParallelLayout(), 1, precision="bf16", distributed_optimizer=False)
    assert report["activated_parameters"] == cfg.activated_parameter_count()


def test_real_sizes_are_the_published_ones():
    q = qwen3_moe.flavour("30b-a3b")  # Qwen3-30B-A3B: 30.5B total, 3.3B activated
    assert sum(q.parameter_counts().values()) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert q.activated_parameter_count() / 1e9 == pytest.approx(3.3, abs=0.1)
    d = deepseek_v3.flavour("671b")  # DeepSeek-V3 (without MTP): 671B total, 37B activated
    assert sum(d.parameter_counts().values()) / 1e9 == pytest.approx(671, abs=0.5)
    assert d.activated_parameter_count() / 1e9 == pytest.approx(37, abs=1.0)


class _Cfg:
    num_layers, tie_embeddings = 2, False


PARAMS = [
    ParameterShape("embedding.word_embeddings.weight", 800, True, False, None, "embedding"),
    ParameterShape("decoder.layers.0.self_attention.linear_qkv.weight", 64, True, False, 0, "layers"),
    ParameterShape("decoder.layers.0.input_layernorm.weight", 8, False, False, 0, "layers"),
    ParameterShape("decoder.layers.1.mlp.router.weight", 32, False, False, 1, "layers"),
    ParameterShape("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", 128, True, True, 1, "layers"),
    ParameterShape("decoder.final_layernorm.weight", 8, False, False, None, "final_norm"),
    ParameterShape("output_layer.weight", 800, True, False, None, "output"),
]


def test_per_gpu_placement_rules():
    # TP=2, PP=2, EP=2, DP=2 (8 GPUs): stage 0 = embedding/2 + qkv/2 + norm; stage 1 = router +
    # experts/(EP*ETP=4) + final norm + output/2
    got = per_gpu(PARAMS, _Cfg(), ParallelLayout(tp=2, pp=2, ep=2), 2, precision="bf16", distributed_optimizer=True)
    assert got["layout"] == {"tp": 2, "pp": 2, "cp": 1, "ep": 2, "dp": 2, "gpus": 8, "expert_tp": 2, "expert_dp": 1}
    worst = got["heaviest_gpu"]
    assert (worst["stage"], worst["parameters"], worst["expert_parameters"]) == (1, 32 + 32 + 8 + 400, 32)
    # bf16 weights (2 B) + fp32 grads (4 B) + Adam state (12 B) sharded over DP=2 (experts: expert-DP 1)
    dense, expert = 32 + 8 + 400, 32
    assert worst["total_bytes"] == (dense + expert) * 6 + dense * 12 // 2 + expert * 12
    fp32 = per_gpu(PARAMS, _Cfg(), ParallelLayout(tp=2, pp=2, ep=2), 2, precision="fp32")["heaviest_gpu"]
    assert fp32["total_bytes"] == (dense + expert) * (4 + 4 + 8)  # no master copy; optimizer not sharded
    with pytest.raises(ValueError, match="parallel.ep=2 must divide"):
        per_gpu(PARAMS, _Cfg(), ParallelLayout(ep=2), 1)


def test_info_prints_counts_and_layout_memory(capsys):
    from loongforge.llm.cli import main

    assert main(["info", "--config", "train_qwen3_moe_debug", "--dp", "2", "parallel.ep=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = qwen3_moe.flavour("debug")
    assert out["family"] == "qwen3_moe"
    assert out["total_parameters"] == sum(cfg.parameter_counts().values())
    assert out["activated_parameters"] == cfg.activated_parameter_count()
    assert out["layout"]["gpus"] == 2
    assert out["heaviest_gpu"]["expert_parameters"] == cfg.parameter_counts()["experts"] // 2


def test_family_selects_the_model_schema():
    cfg = load_llm_config("train_debug", ["model=deepseek_v3_debug", "model.num_experts=8"])
    assert type(cfg.model) is MLAMoEConfig and cfg.model.num_experts == 8
    assert type(load_llm_config("train_qwen3_moe_debug").model) is MoEConfig
    with pytest.raises(ConfigError, match="num_expertz"):
        load_llm_config("train_qwen3_moe_debug", ["model.num_expertz=8"])
    with pytest.raises(ConfigError, match="model.family='nope'"):
        load_llm_config("train_debug", ["model.family=nope"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(moe_router_topk=5), "moe_router_topk=5 exceeds model.num_experts=4"),
    (dict(moe_router_enable_expert_bias=True), "needs model.moe_router_score_function=sigmoid"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "not divisible by model.moe_router_num_groups=3"),
    (dict(moe_router_num_groups=2), "set together"),
    (dict(moe_router_score_function="sigmoid", moe_router_norm_topk_prob=False), "always renormalises"),
    (dict(first_k_dense=3), r"first_k_dense=3 must be in \[0, model.num_layers=2\]"),
    (dict(moe_token_dispatcher="flex"), "moe_token_dispatcher='flex': one of alltoall, allgather"),
])
def test_moe_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


def test_mla_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.num_query_groups=2: multi-latent attention"):
        MLAMoEConfig(num_query_groups=2)
    with pytest.raises(ValueError, match="model.rope_type='ntk'"):
        MLAMoEConfig(rope_type="ntk")
