"""The Hugging Face layouts of the MoE families: Qwen3-MoE (``Qwen3MoeForCausalLM``) and
DeepSeek-V3 (``DeepseekV3ForCausalLM``; with DeepSeek sparse attention, DeepSeek-V3.2's
``DeepseekV32ForCausalLM``: the same tensors plus each layer's ``self_attn.indexer.*``), as the
hub checkpoints store them (one tensor per
expert projection, ``mlp.experts.{expert}.gate_proj.weight``; transformers fuses them into 3-D
tensors when it loads and splits them again in ``save_pretrained``).

LoongForge names are megatron's sharded-state-dict names. Each routed expert's projection is one
index of the expert-stacked tensor ``mlp.experts.experts.linear_fc1.weight`` (megatron's
``SequentialMLP`` folds ``local_experts.{i}`` into a global expert axis, so the layout is the
same under any EP size). Layers come in two kinds (the first ``first_k_dense`` dense, the rest
MoE), so each family's adapter is a ``LayerKindAdapter``.

Three HF details have no megatron-core equivalent and are rejected in ``config_from_hf``:
DeepSeek-V3 ranks expert groups by the sum of their top-2 scores where megatron uses the top
``k / topk_group`` (equal for DeepSeek-V3's 8 / 4); megatron always renormalises top-k sigmoid
scores (``norm_topk_prob=false`` with sigmoid routing); and its local backend builds MLA only
with compressed queries (``q_lora_rank: null``, DeepSeek-V2-Lite style, needs Transformer
Engine's fused norm-linear).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loongforge.core.hf_mapping import BoundMapping, HFAdapter, HFMapping, Ignore, MappingError, Rule
from loongforge.llm.moe_config import MLAMoEConfig, MoEConfig

LAYER, OURS = "model.layers.{layer}.", "decoder.layers.{layer}."
ATTN, SELF_ATTN = LAYER + "self_attn.", OURS + "self_attention."
EXPERT = LAYER + "mlp.experts.{expert}."
OUR_EXPERT = OURS + "mlp.experts.local_experts.{expert}."
EXPERT_AXIS = ("experts.local_experts.{expert}.", "experts.experts.")  # -> expert-stacked sharded key


def gate_up(hf_prefix: str, lf: str) -> Rule:
    """SwiGLU ``gate_proj``/``up_proj`` <-> megatron's fused ``linear_fc1 = [gate; up]``."""
    return Rule((hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"), lf, "fuse_gate_up")


def moe_rules(router_bias: bool) -> tuple[Rule, ...]:
    rules = [
        Rule(LAYER + "mlp.gate.weight", OURS + "mlp.router.weight"),
        gate_up(EXPERT, OUR_EXPERT + "linear_fc1.weight"),
        Rule(EXPERT + "down_proj.weight", OUR_EXPERT + "linear_fc2.weight"),
    ]
    if router_bias:
        rules.append(Rule(LAYER + "mlp.gate.e_score_correction_bias", OURS + "mlp.router.expert_bias",
                          when="moe_router_enable_expert_bias"))
    return tuple(rules)


def _kind(bound: BoundMapping, keep) -> BoundMapping:
    conversions = [c for c in bound.conversions if keep(c.bindings["layer"])]
    names = {n for c in conversions for n in c.lf}
    return BoundMapping(conversions, {n: loc for n, loc in bound.locations.items() if n in names}, bound.ignore)


@dataclass(frozen=True)
class LayerKindAdapter(HFAdapter):
    """The adapter of a family whose layers come in two kinds: ``mapping`` rules hold for every
    layer, ``dense`` rules for the first ``cfg.first_k_dense`` layers and ``moe`` rules for the
    others. (The engine's ``{layer}`` ranges over all layers; each kind's table is bound over all
    of them and the other kind's layers dropped.) HF tensors of layers past ``num_layers``
    (DeepSeek-V3's multi-token-prediction layer, which LoongForge does not build) are ignored on
    import."""

    dense: HFMapping
    moe: HFMapping

    def bind(self, cfg: Any) -> BoundMapping:
        k = cfg.first_k_dense
        bound = self.mapping.bind(cfg) + _kind(self.dense.bind(cfg), lambda i: i < k) + _kind(self.moe.bind(cfg), lambda i: i >= k)
        ours = "|".join(str(i) for i in range(cfg.num_layers))
        extra_layers = re.compile(rf"model\.layers\.(?!(?:{ours})\.)\d+\..*")
        return BoundMapping(bound.conversions, bound.locations, bound.ignore + (extra_layers,))


def _layer_table(rules, **kw) -> HFMapping:
    return HFMapping(rules=rules, ranges={"layer": "num_layers", "expert": "num_experts"}, stacked=(EXPERT_AXIS,), **kw)


# the rules of every layer, of the dense layers' MLPs (the same in both families) and of the MoE layers' MLPs
QWEN3_MOE_LAYERS = _layer_table((
    Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rule(LAYER + "input_layernorm.weight", SELF_ATTN + "linear_qkv.layer_norm_weight"),
    Rule(tuple(ATTN + f"{x}_proj.weight" for x in "qkv"), SELF_ATTN + "linear_qkv.weight", "fuse_qkv"),
    Rule(ATTN + "q_norm.weight", SELF_ATTN + "q_layernorm.weight"),
    Rule(ATTN + "k_norm.weight", SELF_ATTN + "k_layernorm.weight"),
    Rule(ATTN + "o_proj.weight", SELF_ATTN + "linear_proj.weight"),
    # the local spec saves the pre-MLP norm under linear_fc1's name in MoE layers too
    Rule(LAYER + "post_attention_layernorm.weight", OURS + "mlp.linear_fc1.layer_norm_weight"),
    Rule("model.norm.weight", "decoder.final_layernorm.weight"),
    Rule("lm_head.weight", "output_layer.weight", when="not tie_embeddings"),
), ignore=(Ignore("lm_head.weight", when="tie_embeddings"),))
DENSE_MLP = _layer_table((
    gate_up(LAYER + "mlp.", OURS + "mlp.linear_fc1.weight"),
    Rule(LAYER + "mlp.down_proj.weight", OURS + "mlp.linear_fc2.weight"),
))
QWEN3_MOE_MLP = _layer_table(moe_rules(router_bias=False))

DEEPSEEK_V3_LAYERS = _layer_table((
    Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rule(LAYER + "input_layernorm.weight", OURS + "input_layernorm.weight"),
    Rule(ATTN + "q_a_proj.weight", SELF_ATTN + "linear_q_down_proj.weight"),
    Rule(ATTN + "q_a_layernorm.weight", SELF_ATTN + "q_layernorm.weight"),
    Rule(ATTN + "q_b_proj.weight", SELF_ATTN + "linear_q_up_proj.weight"),
    Rule(ATTN + "kv_a_proj_with_mqa.weight", SELF_ATTN + "linear_kv_down_proj.weight"),
    Rule(ATTN + "kv_a_layernorm.weight", SELF_ATTN + "kv_layernorm.weight"),
    Rule(ATTN + "kv_b_proj.weight", SELF_ATTN + "linear_kv_up_proj.weight"),
    Rule(ATTN + "o_proj.weight", SELF_ATTN + "linear_proj.weight"),
    *(Rule(ATTN + f"indexer.{hf}", SELF_ATTN + f"core_attention.indexer.{lf}", when="dsa") for hf, lf in (
        ("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight"), ("k_norm.weight", "k_norm.weight"),
        ("k_norm.bias", "k_norm.bias"), ("weights_proj.weight", "linear_weights_proj.weight"))),
    Rule(LAYER + "post_attention_layernorm.weight", OURS + "pre_mlp_layernorm.weight"),
    Rule("model.norm.weight", "decoder.final_layernorm.weight"),
    Rule("lm_head.weight", "output_layer.weight", when="not tie_embeddings"),
), ignore=(Ignore("lm_head.weight", when="tie_embeddings"),))
DEEPSEEK_V3_MLP = _layer_table((
    *moe_rules(router_bias=True),
    gate_up(LAYER + "mlp.shared_experts.", OURS + "mlp.shared_experts.linear_fc1.weight"),
    Rule(LAYER + "mlp.shared_experts.down_proj.weight", OURS + "mlp.shared_experts.linear_fc2.weight"),
))


# -- config.json ----------------------------------------------------------------------------
def _hf_config(config_class: str, raw: dict):
    import transformers

    return getattr(transformers, config_class).from_dict(raw)  # fills defaults, normalises rope settings


def _require(hf, source: str, family: str, required: dict) -> None:
    for key, value in required.items():
        if getattr(hf, key, value) != value:
            raise MappingError(f"{source}: {key}={getattr(hf, key)!r} is not supported by LoongForge's {family} family "
                               f"(it needs {key}={value!r})")


def _first_k_dense(hf, source: str) -> int:
    dense = sorted(getattr(hf, "mlp_only_layers", None) or [])
    if dense != list(range(len(dense))) or getattr(hf, "decoder_sparse_step", 1) != 1:
        raise MappingError(f"{source}: mlp_only_layers={dense}, decoder_sparse_step={getattr(hf, 'decoder_sparse_step', 1)}: "
                           "LoongForge's MoE families keep only the first layers dense (mlp_only_layers=[0..k-1], step 1)")
    return len(dense)


def qwen3_moe_from_hf(raw: dict) -> MoEConfig:
    source = "config.json of Qwen3MoeForCausalLM"
    hf = _hf_config("Qwen3MoeConfig", raw)
    _require(hf, source, "qwen3_moe", {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False})
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise MappingError(f"{source}: rope_parameters={rope!r}: only the default RoPE (no scaling) is supported")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return MoEConfig(
        family="qwen3_moe",
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf.num_key_value_heads or heads,
        kv_channels=None if head_dim * heads == hf.hidden_size else head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rotary_base=float(rope.get("rope_theta", 10000.0)),
        norm_epsilon=float(hf.rms_norm_eps),
        tie_embeddings=bool(hf.tie_word_embeddings),
        qk_layernorm=True,
        init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        num_experts=hf.num_experts,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_norm_topk_prob=bool(hf.norm_topk_prob),
        first_k_dense=_first_k_dense(hf, source),
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 1e-3)),
    )


def qwen3_moe_to_hf(cfg: MoEConfig) -> dict:
    if cfg.moe_router_score_function != "softmax" or cfg.moe_shared_expert_ffn_hidden_size or cfg.moe_router_num_groups \
            or cfg.moe_router_topk_scaling_factor != 1.0 or not cfg.qk_layernorm or cfg.add_qkv_bias or cfg.rotary_percent != 1.0:
        raise MappingError("model: Qwen3MoeForCausalLM has softmax routing without groups, scaling or shared experts, "
                           "q/k RMSNorm, no q/k/v bias and full-head RoPE; this config differs")
    hf = _hf_config("Qwen3MoeConfig", {})
    hf = type(hf)(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base}, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_method_std, num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
        norm_topk_prob=cfg.moe_router_norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(range(cfg.first_k_dense)),
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
    )
    return hf.to_dict()


def _group_routing(hf, source: str) -> tuple[int, int]:
    groups, group_topk = int(getattr(hf, "n_group", 1) or 1), int(getattr(hf, "topk_group", 1) or 1)
    if groups == 1:
        return 0, 0
    if hf.num_experts_per_tok // group_topk != 2:
        raise MappingError(f"{source}: num_experts_per_tok={hf.num_experts_per_tok}, topk_group={group_topk}: DeepSeek-V3 "
                           "ranks expert groups by their top-2 scores, megatron-core by their top "
                           "num_experts_per_tok // topk_group; they agree only when that is 2")
    return groups, group_topk


DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
# transformers' DeepSeek-V3.2 indexer: key LayerNorm eps 1e-6, ReLU scores, non-interleaved RoPE
V32_INDEXER_NORM_EPS = 1e-6


def deepseek_v3_from_hf(raw: dict) -> MLAMoEConfig:
    v32 = DEEPSEEK_V32 in (raw.get("architectures") or [])
    source = f"config.json of {DEEPSEEK_V32 if v32 else 'DeepseekV3ForCausalLM'}"
    hf = _hf_config("DeepseekV32Config" if v32 else "DeepseekV3Config", raw)
    _require(hf, source, "deepseek_v3", {"hidden_act": "silu", "attention_bias": False, "rope_interleave": True,
                                          "num_key_value_heads": hf.num_attention_heads})
    if v32 and hf.rms_norm_eps != V32_INDEXER_NORM_EPS:
        raise MappingError(f"{source}: rms_norm_eps={hf.rms_norm_eps}: LoongForge's indexer key norm takes the model's "
                           f"epsilon, transformers' DeepSeek-V3.2 indexer always {V32_INDEXER_NORM_EPS}")
    if hf.q_lora_rank is None:
        raise MappingError(f"{source}: q_lora_rank=None: uncompressed MLA queries are not supported "
                           "(megatron-core's local backend builds MLA with a compressed query only)")
    if not hf.norm_topk_prob and hf.num_experts_per_tok > 1:
        raise MappingError(f"{source}: norm_topk_prob=False: megatron-core always renormalises the top-k sigmoid scores")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise MappingError(f"{source}: rope_parameters={rope!r}: only the default RoPE and YaRN are supported")
    yarn: dict[str, Any] = {}  # MLAMoEConfig's YaRN fields
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
            raise MappingError(f"{source}: rope_parameters={rope!r}: YaRN with attention_factor or truncate=false is not supported")
        yarn = dict(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    groups, group_topk = _group_routing(hf, source)
    return MLAMoEConfig(
        family="deepseek_v3",
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rotary_base=float(rope.get("rope_theta", 10000.0)),
        norm_epsilon=float(hf.rms_norm_eps),
        tie_embeddings=bool(hf.tie_word_embeddings),
        init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        **({"rope_type": "rope"} | yarn),
        first_k_dense=int(hf.first_k_dense_replace),
        num_experts=hf.n_routed_experts,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_shared_expert_ffn_hidden_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
        moe_router_topk=hf.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_enable_expert_bias=True,  # e_score_correction_bias
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        **(dict(attention_variant="dsa", dsa_indexer_n_heads=hf.index_n_heads, dsa_indexer_head_dim=hf.index_head_dim,
                dsa_indexer_topk=hf.index_topk) if v32 else {}),
    )


def deepseek_v3_to_hf(cfg: MLAMoEConfig) -> dict:
    shared, expert = cfg.moe_shared_expert_ffn_hidden_size, cfg.moe_ffn_hidden_size
    if cfg.moe_router_score_function != "sigmoid" or not cfg.moe_router_enable_expert_bias or shared % expert:
        raise MappingError("model: DeepseekV3ForCausalLM has sigmoid routing with a correction bias and shared experts "
                           "of moe_ffn_hidden_size each; this config differs")
    if cfg.moe_router_num_groups and cfg.moe_router_topk // cfg.moe_router_group_topk != 2:
        raise MappingError(f"model.moe_router_topk={cfg.moe_router_topk}, model.moe_router_group_topk="
                           f"{cfg.moe_router_group_topk}: DeepseekV3ForCausalLM ranks groups by their top-2 scores")
    if cfg.dsa and cfg.norm_epsilon != V32_INDEXER_NORM_EPS:
        raise MappingError(f"model.norm_epsilon={cfg.norm_epsilon}: the indexer key norm takes it, "
                           f"{DEEPSEEK_V32}'s is always {V32_INDEXER_NORM_EPS}")
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
                "original_max_position_embeddings": cfg.original_max_position_embeddings, "beta_fast": cfg.beta_fast,
                "beta_slow": cfg.beta_slow, "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}
    indexer = dict(index_n_heads=cfg.dsa_indexer_n_heads, index_head_dim=cfg.dsa_indexer_head_dim,
                   index_topk=cfg.dsa_indexer_topk) if cfg.dsa else dict(rope_interleave=True)
    hf = _hf_config("DeepseekV32Config" if cfg.dsa else "DeepseekV3Config", {})
    hf = type(hf)(
        architectures=[DEEPSEEK_V32 if cfg.dsa else "DeepseekV3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=expert, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=shared // expert, n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.moe_router_num_groups or 1,
        topk_group=cfg.moe_router_group_topk or 1, num_experts_per_tok=cfg.moe_router_topk,
        first_k_dense_replace=cfg.first_k_dense, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_method_std,
        num_nextn_predict_layers=0,  # LoongForge does not build the multi-token-prediction layer
        **indexer,
    )
    return hf.to_dict()


QWEN3_MOE_HF = LayerKindAdapter(architectures=("Qwen3MoeForCausalLM",), mapping=QWEN3_MOE_LAYERS, dense=DENSE_MLP,
                                moe=QWEN3_MOE_MLP, config_from_hf=qwen3_moe_from_hf, config_to_hf=qwen3_moe_to_hf)
DEEPSEEK_V3_HF = LayerKindAdapter(architectures=("DeepseekV3ForCausalLM", DEEPSEEK_V32), mapping=DEEPSEEK_V3_LAYERS,
                                  dense=DENSE_MLP, moe=DEEPSEEK_V3_MLP, config_from_hf=deepseek_v3_from_hf, config_to_hf=deepseek_v3_to_hf)
