"""Architecture configs of the Qwen3.5 families: dense (``qwen3_5``) and MoE (``qwen3_5_moe``).

Qwen3.5 is a hybrid decoder: every ``full_attention_interval``-th layer is gated full attention
(GQA with per-head q/k RMSNorm, RoPE on the first ``rotary_percent`` of each head and a sigmoid
output gate per head), the others are Gated DeltaNet linear attention (``linear_*`` fields: q/k/v
heads of their own, a short causal convolution, the gated delta rule, a gated RMSNorm). Its
RMSNorms outside the DeltaNet store ``weight`` zero-centred (they scale by ``1 + weight``), as the
Hugging Face checkpoints do.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.llm.model_config import GPTConfig
from loongforge.llm.moe_config import MoEConfig


@dataclass
class LinearAttentionFields(GPTConfig):
    """The Gated DeltaNet fields both Qwen3.5 configs share, on the GPT config they extend."""

    linear_num_key_heads: int = 2  # DeltaNet query/key heads
    linear_num_value_heads: int = 4  # DeltaNet value heads (a multiple of the key heads)
    linear_key_head_dim: int = 16  # DeltaNet query/key head dim
    linear_value_head_dim: int = 16  # DeltaNet value head dim
    linear_conv_kernel_dim: int = 4  # taps of the short causal convolution over q/k/v
    full_attention_interval: int = 4  # every n-th layer (n, 2n, ...) is full attention, the rest DeltaNet

    def _check_linear_attention(self) -> None:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim", "full_attention_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"model.linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"model.linear_num_key_heads={self.linear_num_key_heads}")

    def is_linear_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` is a DeltaNet layer."""
        return (layer + 1) % self.full_attention_interval != 0

    @property
    def layer_types(self) -> list[str]:
        """Per layer, as Hugging Face's ``layer_types`` names them."""
        return ["linear_attention" if self.is_linear_layer(i) else "full_attention" for i in range(self.num_layers)]

    def _linear_layer_parameters(self) -> int:
        h = self.hidden_size
        qk = self.linear_num_key_heads * self.linear_key_head_dim
        v = self.linear_num_value_heads * self.linear_value_head_dim
        conv = (2 * qk + v) * self.linear_conv_kernel_dim
        return h * (2 * qk + 2 * v + 2 * self.linear_num_value_heads) + conv + 2 * self.linear_num_value_heads \
            + self.linear_value_head_dim + v * h

    def _gated_attention_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        return h * (2 * q + 2 * kv) + q * h + 2 * d

    def _mixer_parameters(self) -> int:
        """The token mixers' parameters over all layers."""
        return sum(self._linear_layer_parameters() if self.is_linear_layer(i) else self._gated_attention_parameters()
                   for i in range(self.num_layers))

    def _mixer_flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token beyond the matmul parameters: causal attention in the full
        layers, the state read and update (about 4 Dk x Dv per value head and token) in DeltaNet."""
        full = sum(1 for i in range(self.num_layers) if not self.is_linear_layer(i))
        linear = self.num_layers - full
        state = 4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return 6.0 * full * seq_length * self.num_attention_heads * self.head_dim + 3.0 * linear * state

    def _gated_attention_kwargs(self) -> dict:
        # a per-layer pattern also tells megatron's block that its layers differ (each is
        # checkpointed under its own decoder.layers.{i}. prefix)
        return dict(attention_output_gate=True,
                    linear_attention_freq=[int(self.is_linear_layer(i)) for i in range(self.num_layers)])


@dataclass
class Qwen35Config(LinearAttentionFields, GPTConfig):
    family: str = "qwen3_5"
    qk_layernorm: bool = True
    rotary_percent: float = 0.25

    def __post_init__(self):
        super().__post_init__()
        self._check_linear_attention()

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), **self._gated_attention_kwargs()}

    def parameter_counts(self) -> dict[str, int]:
        h = self.hidden_size
        mlp = 3 * h * self.ffn_hidden_size
        layers = self._mixer_parameters() + self.num_layers * (mlp + 2 * h) + h
        output = 0 if self.tie_embeddings else self.vocab_size * h
        return {"embedding": self.vocab_size * h, "output": output, "layers": layers}

    def flops_per_token(self, seq_length: int) -> float:
        counts = self.parameter_counts()
        matmul = counts["layers"] + (counts["output"] or counts["embedding"])
        return 6.0 * matmul + self._mixer_flops_per_token(seq_length)


@dataclass
class Qwen35MoEConfig(LinearAttentionFields, MoEConfig):
    family: str = "qwen3_5_moe"
    qk_layernorm: bool = True
    rotary_percent: float = 0.25
    moe_shared_expert_gate: bool = True  # the shared expert's output scaled by sigmoid(a linear of the input)

    def __post_init__(self):
        super().__post_init__()
        self._check_linear_attention()

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), **self._gated_attention_kwargs(),
                "moe_shared_expert_gate": self.moe_shared_expert_gate and bool(self.moe_shared_expert_ffn_hidden_size)}

    def parameter_counts(self) -> dict[str, int]:
        """``MoEConfig``'s parts, the token mixers Qwen3.5's and the shared expert's gate (one
        weight row per MoE layer) in ``layers``."""
        counts = super().parameter_counts()
        gate = self.hidden_size * (self.num_layers - self.first_k_dense) if self.moe_shared_expert_gate \
            and self.moe_shared_expert_ffn_hidden_size else 0
        counts["layers"] += self._mixer_parameters() - self.num_layers * self._attention_parameters() + gate
        return counts

    def _attention_score_flops(self, seq_length: int) -> float:
        return self._mixer_flops_per_token(seq_length)
