"""The architecture config of megatron GPT-style families (Llama, Qwen2.5, Qwen3 ...)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    # the registered model family (loongforge.models): llama, qwen2, qwen3, mistral, qwen3_moe, deepseek_v3
    family: str = "llama"
    num_layers: int = 2  # transformer layers
    hidden_size: int = 64  # model width
    num_attention_heads: int = 4  # query heads
    num_query_groups: int = 2  # KV heads (GQA); == num_attention_heads for MHA
    ffn_hidden_size: int = 128  # hidden width of the (SwiGLU) MLP
    vocab_size: int = 4096  # model vocab (>= tokenizer vocab; padded for TP)
    max_position_embeddings: int = 4096  # longest sequence the RoPE tables cover
    kv_channels: int | None = None  # head dim; default hidden_size // num_attention_heads
    rotary_base: float = 10000.0  # RoPE base frequency (rope_theta)
    rotary_percent: float = 1.0  # share of each head's dims that get RoPE
    norm_epsilon: float = 1e-5  # epsilon of the RMSNorms
    tie_embeddings: bool = False  # the output layer shares the input embedding's weights
    qk_layernorm: bool = False  # Qwen3
    add_qkv_bias: bool = False  # Qwen2.5
    init_method_std: float = 0.02  # standard deviation of the random weight init
    # An HF model directory or Hugging Face Hub id (owner/name[@revision]) to start from: the
    # architecture comes from its config.json (the rest of the model section is ignored) and the
    # weights from its safetensors, read per TP/PP/EP shard.
    # Not part of the architecture record that checkpoints compare (see ``architecture``).
    init_from_hf: str | None = None

    def __post_init__(self):
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}; set model.kv_channels"
            )

    def architecture(self) -> dict:
        """The fields that define the model: what a checkpoint records and a resume compares."""
        from loongforge.core.config import to_dict

        return {k: v for k, v in to_dict(self).items() if k != "init_from_hf"}

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def transformer_config_kwargs(self) -> dict:
        """The architecture part of megatron's TransformerConfig; families with more
        architecture (MoE, multi-latent attention) extend it in their config subclass."""
        import torch.nn.functional as F

        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=self.init_method_std,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
        )

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part: embedding, output layer and the transformer layers."""
        h, d, L = self.hidden_size, self.head_dim, self.num_layers
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.add_qkv_bias else 0) + (2 * d if self.qk_layernorm else 0)
        mlp = 3 * h * self.ffn_hidden_size
        layer = attn + mlp + 2 * h
        embedding = self.vocab_size * h
        output = 0 if self.tie_embeddings else self.vocab_size * h
        return {"embedding": embedding, "output": output, "layers": L * layer + h}

    def balance_flops_per_token(self, seq_length: int) -> float:
        """The FLOPs per token the DP balancer's cost model is fit from, which must be affine in the
        length (``CostModel.from_flops_per_token``): here ``flops_per_token``."""
        return self.flops_per_token(seq_length)

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 x matmul params (incl. the output layer) plus causal
        attention scores and values, 6 * layers * seq * (heads * head_dim) (half of 12, causal)."""
        counts = self.parameter_counts()
        matmul = counts["layers"] + (counts["output"] or counts["embedding"])
        return 6.0 * matmul + 6.0 * self.num_layers * seq_length * self.num_attention_heads * self.head_dim
