"""The Hugging Face layout of the Qwen3.5 families (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``).

Layers come in two kinds, named by the config's ``layer_types``: full attention
(``self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``) and Gated DeltaNet (``linear_attn.*``, the
same names in our ``GatedDeltaNet``). The full layers' ``q_proj`` holds, per head, the query and
then its output gate (``[heads, 2, head_dim]`` rows); megatron's gated ``linear_qkv`` holds per
query group its query heads, their gates, the key and the value (``fuse_gated_qkv``). LoongForge
names are megatron's sharded-state-dict names; the layers are not homogeneous, so each has its own
``decoder.layers.{layer}.`` prefix. Checkpoints' multi-token-prediction tensors (``mtp.*``) are
not built and are ignored on import. ``config_from_hf`` refuses what the family cannot honour by
key (attention biases, RoPE scaling, layer patterns other than every n-th layer full).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loongforge.core.hf_mapping import BoundMapping, HFAdapter, HFMapping, Ignore, MappingError, Rule
from loongforge.core.hf_mapping.transforms import Transform, config_value, register_transform
from loongforge.llm.qwen3_5_config import LinearAttentionFields, Qwen35Config, Qwen35MoEConfig

LAYER, OURS = "model.layers.{layer}.", "decoder.layers.{layer}."
ATTN, SELF_ATTN = LAYER + "self_attn.", OURS + "self_attention."
LINEAR, DELTA_NET = LAYER + "linear_attn.", OURS + "self_attention."
DELTA_NET_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                     "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


class FuseGatedQKV(Transform):
    """HF ``q_proj`` (per head ``[query; gate]``), ``k_proj``, ``v_proj`` <-> megatron's gated
    ``linear_qkv``: per KV group its query heads, their gates, its key head and its value head."""

    n_hf, n_lf = 3, 1
    splits_rows = True

    def _dims(self, ctx) -> tuple[int, int, int]:
        heads, groups = int(config_value(ctx.cfg, "num_attention_heads")), int(config_value(ctx.cfg, "num_query_groups"))
        return heads, groups, int(config_value(ctx.cfg, "head_dim"))

    def to_lf(self, tensors, ctx):
        heads, groups, d = self._dims(ctx)
        q_gate, k, v = tensors
        for name, t, rows in zip(ctx.hf, tensors, (2 * heads * d, groups * d, groups * d)):
            if t.shape[0] != rows:
                raise MappingError(f"{name}: shape {list(t.shape)}, expected {rows} rows ({heads} gated heads, "
                                   f"{groups} KV groups, head dim {d})")
        rest = q_gate.shape[1:]
        per = heads // groups
        q_gate = q_gate.reshape(groups, per, 2, d, *rest)
        fused = torch.cat([q_gate[:, :, 0].reshape(groups, per * d, *rest), q_gate[:, :, 1].reshape(groups, per * d, *rest),
                           k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1)
        return [fused.reshape(groups * (2 * per + 2) * d, *rest)]

    def to_hf(self, tensors, ctx):
        heads, groups, d = self._dims(ctx)
        (qkv,) = tensors
        per = heads // groups
        if qkv.shape[0] != groups * (2 * per + 2) * d:
            raise MappingError(f"{ctx.lf[0]}: shape {list(qkv.shape)}, expected {groups * (2 * per + 2) * d} rows")
        rest = qkv.shape[1:]
        q, gate, k, v = qkv.reshape(groups, (2 * per + 2) * d, *rest).split([per * d, per * d, d, d], dim=1)
        q_gate = torch.stack([q.reshape(groups, per, d, *rest), gate.reshape(groups, per, d, *rest)], dim=2)
        own = dict(memory_format=torch.contiguous_format)  # each its own storage (safetensors refuses shared memory)
        return [q_gate.reshape(2 * heads * d, *rest).clone(**own), k.reshape(groups * d, *rest).clone(**own),
                v.reshape(groups * d, *rest).clone(**own)]


register_transform("fuse_gated_qkv", FuseGatedQKV())

FULL_ATTENTION_RULES = (
    Rule(LAYER + "input_layernorm.weight", SELF_ATTN + "linear_qkv.layer_norm_weight"),
    Rule(tuple(ATTN + f"{x}_proj.weight" for x in "qkv"), SELF_ATTN + "linear_qkv.weight", "fuse_gated_qkv"),
    Rule(ATTN + "q_norm.weight", SELF_ATTN + "q_layernorm.weight"),
    Rule(ATTN + "k_norm.weight", SELF_ATTN + "k_layernorm.weight"),
    Rule(ATTN + "o_proj.weight", SELF_ATTN + "linear_proj.weight"),
)
DELTA_NET_RULES = (
    Rule(LAYER + "input_layernorm.weight", OURS + "input_layernorm.weight"),
    *(Rule(LINEAR + name, DELTA_NET + name) for name in DELTA_NET_TENSORS),
)
COMMON_RULES = (
    Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rule(LAYER + "post_attention_layernorm.weight", OURS + "mlp.linear_fc1.layer_norm_weight"),
    Rule("model.norm.weight", "decoder.final_layernorm.weight"),
    Rule("lm_head.weight", "output_layer.weight", when="not tie_embeddings"),
)
DENSE_MLP_RULES = (
    Rule((LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight"), OURS + "mlp.linear_fc1.weight", "fuse_gate_up"),
    Rule(LAYER + "mlp.down_proj.weight", OURS + "mlp.linear_fc2.weight"),
)
IGNORED = (Ignore("lm_head.weight", when="tie_embeddings"),)
MULTI_TOKEN_PREDICTION = re.compile(r"mtp\..*")  # the checkpoints' MTP head, not built


def _of_layers(bound: BoundMapping, keep) -> BoundMapping:
    conversions = [c for c in bound.conversions if "layer" not in c.bindings or keep(c.bindings["layer"])]
    names = {n for c in conversions for n in c.lf}
    return BoundMapping(conversions, {n: loc for n, loc in bound.locations.items() if n in names}, bound.ignore)


@dataclass(frozen=True)
class HybridLayerAdapter(HFAdapter):
    """The adapter of a hybrid family: ``mapping`` holds the rules of every layer, ``full`` those
    of the full-attention layers and ``linear`` those of the DeltaNet ones
    (``cfg.is_linear_layer``); each table is bound over all layers and the other kind's layers
    dropped."""

    full: HFMapping
    linear: HFMapping

    def bind(self, cfg: LinearAttentionFields) -> BoundMapping:
        bound = (self.mapping.bind(cfg) + _of_layers(self.full.bind(cfg), lambda i: not cfg.is_linear_layer(i))
                 + _of_layers(self.linear.bind(cfg), cfg.is_linear_layer))
        return BoundMapping(bound.conversions, bound.locations, bound.ignore + (MULTI_TOKEN_PREDICTION,))


def hybrid_adapter(architecture: str, mlp_rules: tuple[Rule, ...], ranges: dict, config_from_hf: Callable[[dict], Any],
                   config_to_hf: Callable[[Any], dict], stacked=()) -> HybridLayerAdapter:
    """The adapter of a Qwen3.5 family reading ``architecture``, its MLPs mapped by ``mlp_rules``."""
    def table(rules, **kw):
        return HFMapping(rules=rules, ranges=ranges, stacked=stacked, **kw)

    return HybridLayerAdapter(architectures=(architecture,), mapping=table(COMMON_RULES + mlp_rules, ignore=IGNORED),
                              full=table(FULL_ATTENTION_RULES), linear=table(DELTA_NET_RULES),
                              config_from_hf=config_from_hf, config_to_hf=config_to_hf)


def text_config(config_class: str, raw: dict):
    """transformers' ``config_class`` of ``raw`` (defaults filled, RoPE settings normalised)."""
    import transformers

    return getattr(transformers, config_class).from_dict(raw)


def interval_of(layer_types: list[str], source: str) -> int:
    """The n of ``layer_types`` where every n-th layer is full attention and the others linear."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    n = full[0] + 1 if full else len(layer_types) + 1
    expected = ["linear_attention" if (i + 1) % n else "full_attention" for i in range(len(layer_types))]
    if unknown or list(layer_types) != expected:
        raise MappingError(f"{source}: layer_types={list(layer_types)!r}: LoongForge's Qwen3.5 families need every "
                           "n-th layer full attention and the others linear attention")
    return n


def common_fields(hf, source: str, family: str) -> dict:
    """The model-config fields both families read from ``hf`` (a Qwen3.5 text config)."""
    for key, value in {"hidden_act": "silu", "attention_bias": False}.items():
        if getattr(hf, key, value) != value:
            raise MappingError(f"{source}: {key}={getattr(hf, key)!r} is not supported by LoongForge's {family} "
                               f"family (it needs {key}={value!r})")
    rope = dict(hf.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise MappingError(f"{source}: rope_parameters={rope!r}: only the default RoPE (no scaling) is supported")
    heads = hf.num_attention_heads
    return dict(
        family=family, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=heads,
        num_query_groups=hf.num_key_value_heads or heads, kv_channels=hf.head_dim, vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings, rotary_base=float(rope.get("rope_theta", 10000.0)),
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)), norm_epsilon=float(hf.rms_norm_eps),
        tie_embeddings=bool(hf.tie_word_embeddings), qk_layernorm=True,
        init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
        linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, full_attention_interval=interval_of(hf.layer_types, source),
    )


def common_hf_kwargs(cfg: Qwen35Config | Qwen35MoEConfig, architecture: str) -> dict:
    """The HF config entries both families write."""
    if not cfg.qk_layernorm or cfg.add_qkv_bias:
        raise MappingError(f"model: {architecture} has q/k RMSNorm and no q/k/v bias; this config differs")
    return dict(
        architectures=[architecture], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base,
                         "partial_rotary_factor": cfg.rotary_percent},
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_method_std, attention_bias=False,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, layer_types=cfg.layer_types,
    )


def qwen3_5_from_hf(raw: dict) -> Qwen35Config:
    source = "config.json of Qwen3_5ForCausalLM"
    hf = text_config("Qwen3_5TextConfig", raw)
    return Qwen35Config(**common_fields(hf, source, "qwen3_5"), ffn_hidden_size=hf.intermediate_size)


def qwen3_5_to_hf(cfg: Qwen35Config) -> dict:
    import transformers

    hf = transformers.Qwen3_5TextConfig(**common_hf_kwargs(cfg, "Qwen3_5ForCausalLM"),
                                        intermediate_size=cfg.ffn_hidden_size)
    return hf.to_dict()


QWEN3_5_HF = hybrid_adapter("Qwen3_5ForCausalLM", DENSE_MLP_RULES, {"layer": "num_layers"}, qwen3_5_from_hf,
                            qwen3_5_to_hf)


def _moe_rules() -> tuple[Rule, ...]:
    from loongforge.llm.families.moe_hf import gate_up, moe_rules

    shared = LAYER + "mlp.shared_expert."
    return (*moe_rules(router_bias=False),
            gate_up(shared, OURS + "mlp.shared_experts.linear_fc1.weight"),
            Rule(shared + "down_proj.weight", OURS + "mlp.shared_experts.linear_fc2.weight"),
            Rule(LAYER + "mlp.shared_expert_gate.weight", OURS + "mlp.shared_experts.gate_weight"))


def qwen3_5_moe_from_hf(raw: dict) -> Qwen35MoEConfig:
    """Every layer's MLP is the sparse block: softmax top-k over the routed experts (renormalised),
    plus one shared expert scaled by a sigmoid gate."""
    source = "config.json of Qwen3_5MoeForCausalLM"
    hf = text_config("Qwen3_5MoeTextConfig", raw)
    shared = hf.shared_expert_intermediate_size or 0
    return Qwen35MoEConfig(
        **common_fields(hf, source, "qwen3_5_moe"), ffn_hidden_size=hf.moe_intermediate_size,
        num_experts=hf.num_experts, moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_topk=hf.num_experts_per_tok,
        moe_router_norm_topk_prob=True, moe_shared_expert_ffn_hidden_size=shared, moe_shared_expert_gate=bool(shared),
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 1e-3)),
    )


def qwen3_5_moe_to_hf(cfg: Qwen35MoEConfig) -> dict:
    import transformers

    if cfg.moe_router_score_function != "softmax" or not cfg.moe_router_norm_topk_prob or cfg.first_k_dense \
            or cfg.moe_router_num_groups or cfg.moe_router_topk_scaling_factor != 1.0 \
            or cfg.moe_shared_expert_gate != bool(cfg.moe_shared_expert_ffn_hidden_size):
        raise MappingError("model: Qwen3_5MoeForCausalLM has renormalised softmax top-k routing in every layer, "
                           "without groups or scaling, and a gated shared expert; this config differs")
    hf = transformers.Qwen3_5MoeTextConfig(
        **common_hf_kwargs(cfg, "Qwen3_5MoeForCausalLM"), moe_intermediate_size=cfg.moe_ffn_hidden_size,
        shared_expert_intermediate_size=cfg.moe_shared_expert_ffn_hidden_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk, router_aux_loss_coef=cfg.moe_aux_loss_coeff)
    return hf.to_dict()


def _moe_adapter() -> HybridLayerAdapter:
    from loongforge.llm.families.moe_hf import EXPERT_AXIS

    return hybrid_adapter("Qwen3_5MoeForCausalLM", _moe_rules(), {"layer": "num_layers", "expert": "num_experts"},
                          qwen3_5_moe_from_hf, qwen3_5_moe_to_hf, stacked=(EXPERT_AXIS,))


QWEN3_5_MOE_HF = _moe_adapter()
