"""The Hugging Face layout of the GPT-style families (Llama, Qwen2.5, Qwen3).

transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` share one
state-dict layout; they differ in q/k/v biases (Qwen2.5), per-head q/k RMSNorm (Qwen3) and
tied embeddings, which the table switches on from the model config. Each family builds its
``HFAdapter`` with ``gpt_hf_adapter``, naming its architecture, its transformers config class
and the HF features it rejects.
"""

from __future__ import annotations

from loongforge.core.hf_mapping import HFAdapter, HFMapping, Ignore, MappingError, Rule
from loongforge.llm.model_config import GPTConfig

LAYER = "model.layers.{layer}."
OURS = "decoder.layers.{layer}."
ATTN, SELF_ATTN = LAYER + "self_attn.", OURS + "self_attention."
QKV = tuple(ATTN + f"{x}_proj." for x in "qkv")

GPT_HF_MAPPING = HFMapping(
    rules=(
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        Rule(LAYER + "input_layernorm.weight", SELF_ATTN + "linear_qkv.layer_norm_weight"),
        Rule(tuple(p + "weight" for p in QKV), SELF_ATTN + "linear_qkv.weight", "fuse_qkv"),
        Rule(tuple(p + "bias" for p in QKV), SELF_ATTN + "linear_qkv.bias", "fuse_qkv", when="add_qkv_bias"),
        Rule(ATTN + "q_norm.weight", SELF_ATTN + "q_layernorm.weight", when="qk_layernorm"),
        Rule(ATTN + "k_norm.weight", SELF_ATTN + "k_layernorm.weight", when="qk_layernorm"),
        Rule(ATTN + "o_proj.weight", SELF_ATTN + "linear_proj.weight"),
        Rule(LAYER + "post_attention_layernorm.weight", OURS + "mlp.linear_fc1.layer_norm_weight"),
        Rule((LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight"), OURS + "mlp.linear_fc1.weight", "fuse_gate_up"),
        Rule(LAYER + "mlp.down_proj.weight", OURS + "mlp.linear_fc2.weight"),
        Rule("model.norm.weight", "decoder.final_layernorm.weight"),
        Rule("lm_head.weight", "output_layer.weight", when="not tie_embeddings"),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
    ignore=(
        Ignore(ATTN + "rotary_emb.inv_freq"),  # a buffer older transformers versions saved
        Ignore("lm_head.weight", when="tie_embeddings"),  # some tied checkpoints still store the copy
    ),
)


def gpt_hf_adapter(family: str, architecture: str, config_class: str, *, add_qkv_bias: bool = False,
                   qk_layernorm: bool = False, unsupported: dict[str, object] | None = None) -> HFAdapter:
    """The adapter of a GPT-style family whose HF model is ``architecture`` (transformers
    config class ``config_class``), with or without q/k/v biases and q/k RMSNorm.
    ``unsupported`` maps HF config keys to the only value the family accepts (e.g.
    ``{"attention_bias": False}``); any other value is an error naming the key."""
    fixed = {"add_qkv_bias": add_qkv_bias, "qk_layernorm": qk_layernorm}
    required = {"hidden_act": "silu", **(unsupported or {})}

    def hf_class():
        import transformers

        return getattr(transformers, config_class)

    def config_from_hf(raw: dict) -> GPTConfig:
        source = f"config.json of {architecture}"
        hf = hf_class().from_dict(raw)  # fills transformers' defaults, normalises rope settings
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        for key, value in required.items():
            if getattr(hf, key, value) != value:
                raise MappingError(f"{source}: {key}={getattr(hf, key)!r} is not supported by LoongForge's {family} "
                                   f"family (it needs {key}={value!r})")
        if rope.get("rope_type", "default") != "default":
            raise MappingError(f"{source}: rope_parameters={rope!r}: only the default RoPE (no scaling) is supported")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        return GPTConfig(
            family=family,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=heads,
            num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
            ffn_hidden_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            kv_channels=None if head_dim * heads == hf.hidden_size else head_dim,
            rotary_base=float(rope.get("rope_theta", 10000.0)),
            norm_epsilon=float(hf.rms_norm_eps),
            tie_embeddings=bool(hf.tie_word_embeddings),
            add_qkv_bias=add_qkv_bias,
            qk_layernorm=qk_layernorm,
            init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        )

    def config_to_hf(cfg: GPTConfig) -> dict:
        if cfg.rotary_percent != 1.0:
            raise MappingError(f"model.rotary_percent={cfg.rotary_percent}: {architecture} applies RoPE to the whole head")
        for key, value in fixed.items():
            if getattr(cfg, key) != value:
                raise MappingError(f"model.{key}={getattr(cfg, key)}: {architecture} has {key}={value}")
        # Qwen2's config has no head_dim (its attention reads it when present): write it where
        # the class has one, or where it is not hidden_size / heads.
        explicit = "head_dim" in hf_class()().to_dict() or cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
        hf = hf_class()(
            architectures=[architecture],
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_query_groups,
            **({"head_dim": cfg.head_dim} if explicit else {}),
            max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.norm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_method_std,
            **required,  # hidden_act=silu and the values the family needs where the class defaults to others
        )
        return hf.to_dict()

    return HFAdapter(architectures=(architecture,), mapping=GPT_HF_MAPPING, config_from_hf=config_from_hf,
                     config_to_hf=config_to_hf)
