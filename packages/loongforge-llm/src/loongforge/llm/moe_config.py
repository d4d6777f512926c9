"""Architecture configs of the mixture-of-experts families (Qwen3-MoE, DeepSeek-V3/V3.2).

``MoEConfig`` is a ``GPTConfig`` whose MLP is megatron-core's ``MoELayer`` (a top-k router,
routed experts, optional shared experts) in every layer but the first ``first_k_dense``.
``MLAMoEConfig`` adds DeepSeek's multi-latent attention and, with ``attention_variant: dsa``,
DeepSeek-V3.2's sparse attention (a lightning indexer picks the keys each query attends to).
Field names follow the papers and the Hugging Face configs; ``transformer_config_kwargs``
translates them to megatron's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.llm.model_config import GPTConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
ROPE_TYPES = ("rope", "yarn")
ATTENTION_VARIANTS = ("mla", "dsa")


@dataclass
class MoEConfig(GPTConfig):
    family: str = "qwen3_moe"
    num_experts: int = 4  # routed experts per MoE layer
    moe_ffn_hidden_size: int = 32  # hidden size of one routed expert
    moe_router_topk: int = 2  # routed experts per token
    moe_shared_expert_ffn_hidden_size: int = 0  # all shared experts together; 0: none
    first_k_dense: int = 0  # the first k layers keep a dense MLP of ffn_hidden_size
    moe_router_score_function: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid (DeepSeek-V3)
    moe_router_norm_topk_prob: bool = True  # renormalise the k selected probabilities to sum to 1
    moe_router_topk_scaling_factor: float = 1.0  # routed_scaling_factor (DeepSeek-V3: 2.5)
    moe_router_num_groups: int = 0  # group-limited routing: expert groups (0: off)
    moe_router_group_topk: int = 0  # groups each token may use
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing bias (sigmoid only)
    moe_router_bias_update_rate: float = 1e-3  # step size of the expert bias (moe_router_enable_expert_bias)
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float = 1e-3  # weight of the load-balancing loss
    moe_z_loss_coeff: float = 0.0  # 0: no router z-loss
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    # overlap the expert-parallel all-to-all of one micro-batch with the computation of another
    # (megatron-core's combined 1F1B schedule; needs parallel.ep > 1, bf16, no recomputation)
    moe_a2a_overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts={self.num_experts}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} must be in [0, model.num_layers={self.num_layers}]")
        if self.moe_shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"model.moe_shared_expert_ffn_hidden_size={self.moe_shared_expert_ffn_hidden_size}: must be >= 0")
        self._check_choice("moe_router_score_function", SCORE_FUNCTIONS)
        self._check_choice("moe_router_load_balancing_type", LOAD_BALANCING)
        self._check_choice("moe_token_dispatcher", DISPATCHERS)
        if self.moe_router_score_function == "sigmoid" and self.moe_router_topk > 1 and not self.moe_router_norm_topk_prob:
            raise ValueError("model.moe_router_norm_topk_prob=false: megatron-core always renormalises the top-k "
                             "sigmoid scores (k > 1); use the softmax score function for unnormalised probabilities")
        if self.moe_router_score_function == "softmax" and self.moe_router_topk == 1 and self.moe_router_norm_topk_prob:
            raise ValueError("model.moe_router_topk=1 with model.moe_router_norm_topk_prob=true gives a constant "
                             "probability of 1 (no router gradient); set moe_router_norm_topk_prob=false")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid")
        if bool(self.moe_router_num_groups) != bool(self.moe_router_group_topk):
            raise ValueError("model.moe_router_num_groups and model.moe_router_group_topk are set together (or both 0)")
        if self.moe_router_num_groups:
            if self.num_experts % self.moe_router_num_groups:
                raise ValueError(f"model.num_experts={self.num_experts} is not divisible by "
                                 f"model.moe_router_num_groups={self.moe_router_num_groups}")
            if not 0 < self.moe_router_group_topk <= self.moe_router_num_groups:
                raise ValueError(f"model.moe_router_group_topk={self.moe_router_group_topk} must be in "
                                 f"[1, model.moe_router_num_groups={self.moe_router_num_groups}]")

    def _check_choice(self, key: str, choices: tuple[str, ...]) -> None:
        if getattr(self, key) not in choices:
            raise ValueError(f"model.{key}={getattr(self, key)!r}: one of {', '.join(choices)}")

    # -- megatron ---------------------------------------------------------------------------
    @property
    def moe_layer_pattern(self) -> list[int]:
        """Per layer: 1 for an MoE MLP, 0 for a dense one (megatron's ``moe_layer_freq``)."""
        return [0] * self.first_k_dense + [1] * (self.num_layers - self.first_k_dense)

    def transformer_config_kwargs(self) -> dict:
        kwargs = super().transformer_config_kwargs()
        softmax = self.moe_router_score_function == "softmax"
        kwargs.update(
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.moe_router_topk,
            moe_layer_freq=self.moe_layer_pattern,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_ffn_hidden_size or None,
            moe_router_score_function=self.moe_router_score_function,
            # softmax over the k selected logits == softmax over all, renormalised over the k
            moe_router_pre_softmax=softmax and not self.moe_router_norm_topk_prob,
            moe_router_topk_scaling_factor=self.moe_router_topk_scaling_factor if self.moe_router_topk_scaling_factor != 1.0 else None,
            moe_router_num_groups=self.moe_router_num_groups or None,
            moe_router_group_topk=self.moe_router_group_topk or None,
            moe_router_enable_expert_bias=self.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=self.moe_router_bias_update_rate,
            moe_router_load_balancing_type=self.moe_router_load_balancing_type,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_z_loss_coeff=self.moe_z_loss_coeff or None,
            moe_router_dtype="fp32",  # routing decisions in fp32 whatever the training precision
            moe_token_dispatcher_type=self.moe_token_dispatcher,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            overlap_moe_expert_parallel_comm=self.moe_a2a_overlap,
        )
        return kwargs

    # -- sizes ------------------------------------------------------------------------------
    def _attention_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        return h * (q + 2 * kv) + q * h + (q + 2 * kv if self.add_qkv_bias else 0) + (2 * d if self.qk_layernorm else 0)

    def _moe_layer_parts(self) -> dict[str, int]:
        h = self.hidden_size
        return {
            "router": self.num_experts * h,
            "routed_experts": self.num_experts * 3 * h * self.moe_ffn_hidden_size,
            "shared_experts": 3 * h * self.moe_shared_expert_ffn_hidden_size,
        }

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part; ``experts`` are the routed experts of all MoE layers, ``layers``
        everything else in the transformer layers (attention, dense MLPs, routers, shared
        experts, norms) plus the final norm."""
        h = self.hidden_size
        moe_layers = self.num_layers - self.first_k_dense
        parts = self._moe_layer_parts()
        per_layer = self._attention_parameters() + 2 * h
        layers = self.num_layers * per_layer + self.first_k_dense * 3 * h * self.ffn_hidden_size
        layers += moe_layers * (parts["router"] + parts["shared_experts"]) + h
        return {
            "embedding": self.vocab_size * h,
            "output": 0 if self.tie_embeddings else self.vocab_size * h,
            "layers": layers,
            "experts": moe_layers * parts["routed_experts"],
        }

    def activated_parameter_count(self) -> int:
        """Parameters one token passes through: all but the unselected routed experts."""
        counts = self.parameter_counts()
        active_experts = counts["experts"] * self.moe_router_topk // self.num_experts
        return sum(counts.values()) - counts["experts"] + active_experts

    def _attention_score_flops(self, seq_length: int) -> float:
        return 6.0 * self.num_layers * seq_length * self.num_attention_heads * self.head_dim

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 x the matmul parameters a token passes through (the
        selected experts only; the output layer, or the tied embedding) plus causal attention."""
        counts = self.parameter_counts()
        active_experts = counts["experts"] * self.moe_router_topk / self.num_experts
        layers = sum(counts.values()) - counts["experts"] - counts["embedding"] - counts["output"]
        matmul = layers + active_experts + (counts["output"] or counts["embedding"])
        return 6.0 * matmul + self._attention_score_flops(seq_length)


@dataclass
class MLAMoEConfig(MoEConfig):
    """DeepSeek-V3: multi-latent attention (low-rank compressed queries and keys/values, a
    shared rotary key) over a MoE with shared experts and sigmoid, group-limited routing.

    ``attention_variant: dsa`` is DeepSeek-V3.2's sparse attention (megatron's DSAttention):
    per layer, a lightning indexer (``dsa_indexer_n_heads`` heads of ``dsa_indexer_head_dim``,
    ReLU scores weighted per head) scores every earlier token for each query, and the query
    attends to its ``dsa_indexer_topk`` best only (MLA in its absorbed, MQA form). The indexer
    reads detached activations; it learns from its own KL loss towards the main attention's
    distribution (``dsa_indexer_loss_coeff``; over all keys, or the selected ones with
    ``dsa_indexer_use_sparse_loss``), which leaves the language-model gradients untouched.
    """

    family: str = "deepseek_v3"
    num_query_groups: int = 4  # == num_attention_heads: one key/value head per query head
    qk_layernorm: bool = True  # the RMSNorms on the compressed query and key/value latents
    q_lora_rank: int = 32  # rank of the compressed query (the local backend has no uncompressed MLA query)
    kv_lora_rank: int = 16  # rank of the compressed key/value latent
    qk_nope_head_dim: int = 16  # per-head query/key dims without rotary embedding
    qk_rope_head_dim: int = 8  # per-head query/key dims with rotary embedding
    v_head_dim: int = 16  # per-head value dims
    rope_type: str = "rope"  # rope | yarn
    rotary_scaling_factor: float = 40.0  # yarn only
    original_max_position_embeddings: int = 4096  # yarn only
    beta_fast: float = 32.0  # yarn only: fast rotation boundary
    beta_slow: float = 1.0  # yarn only: slow rotation boundary
    mscale: float = 1.0  # yarn only: attention scale factor
    mscale_all_dim: float = 1.0  # yarn only: attention scale factor over all dims
    attention_variant: str = "mla"  # mla | dsa (DeepSeek-V3.2 sparse attention)
    dsa_indexer_n_heads: int = 4  # dsa only: the indexer's heads (V3.2: 64)
    dsa_indexer_head_dim: int = 32  # dsa only: per indexer head; the first qk_rope_head_dim get RoPE (V3.2: 128)
    dsa_indexer_topk: int = 32  # dsa only: keys each query attends to (V3.2: 2048)
    dsa_indexer_loss_coeff: float = 1e-2  # dsa only: the indexer's KL loss; 0 leaves the indexer untrained
    dsa_indexer_use_sparse_loss: bool = False  # dsa only: KL over the selected keys (V3.2's sparse stage)
    # dsa only: Hadamard-rotate the indexer's q/k (V3.2 does, for its FP8 indexer; the scores are
    # rotation-invariant otherwise). Needs the fast_hadamard_transform package and bf16.
    dsa_indexer_rotate_activation: bool = False

    def __post_init__(self):
        super().__post_init__()
        self._check_choice("rope_type", ROPE_TYPES)
        self._check_choice("attention_variant", ATTENTION_VARIANTS)
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(f"model.num_query_groups={self.num_query_groups}: multi-latent attention has one key/value "
                             f"head per query head (set it to model.num_attention_heads={self.num_attention_heads})")
        if not self.qk_layernorm:
            raise ValueError("model.qk_layernorm=false: multi-latent attention normalises its compressed latents")
        if self.add_qkv_bias:
            raise ValueError("model.add_qkv_bias=true is not supported with multi-latent attention")
        if self.attention_variant == "dsa":
            self._check_indexer()

    def _check_indexer(self) -> None:
        for key in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.dsa_indexer_head_dim <= self.qk_rope_head_dim:
            raise ValueError(f"model.dsa_indexer_head_dim={self.dsa_indexer_head_dim} must exceed "
                             f"model.qk_rope_head_dim={self.qk_rope_head_dim} (RoPE takes that many of its dims)")
        if self.dsa_indexer_loss_coeff < 0:
            raise ValueError(f"model.dsa_indexer_loss_coeff={self.dsa_indexer_loss_coeff}: must be >= 0")
        if self.dsa_indexer_rotate_activation:
            import importlib.util

            if importlib.util.find_spec("fast_hadamard_transform") is None:
                raise ValueError("model.dsa_indexer_rotate_activation=true needs the fast_hadamard_transform "
                                 "package (CUDA), which is not installed")

    @property
    def dsa(self) -> bool:
        return self.attention_variant == "dsa"

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def mla_config_kwargs(self) -> dict:
        """The fields megatron's ``MLATransformerConfig`` adds to ``TransformerConfig``. megatron
        scales MLA's softmax by YaRN's mscale whatever the RoPE type, so plain RoPE passes the
        neutral YaRN values (scaling factor 1, no mscale)."""
        yarn = self.rope_type == "yarn"
        return dict(
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_type=self.rope_type,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            rotary_scaling_factor=self.rotary_scaling_factor if yarn else 1.0,
            original_max_position_embeddings=self.original_max_position_embeddings,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim if yarn else 0.0,
        )

    def transformer_config_kwargs(self) -> dict:
        """The DSA fields sit on megatron's base TransformerConfig, so the run's config carries
        them too: megatron's schedules then hand the main loss scale to the indexer loss."""
        kwargs = super().transformer_config_kwargs()
        if self.dsa:
            kwargs.update(
                experimental_attention_variant="dsa",
                dsa_indexer_n_heads=self.dsa_indexer_n_heads,
                dsa_indexer_head_dim=self.dsa_indexer_head_dim,
                dsa_indexer_topk=self.dsa_indexer_topk,
                dsa_indexer_loss_coeff=self.dsa_indexer_loss_coeff,
                dsa_indexer_use_sparse_loss=self.dsa_indexer_use_sparse_loss,
                dsa_indexer_rotate_activation=self.dsa_indexer_rotate_activation,
                dsa_indexer_scoring_relu=True,  # DeepSeek-V3.2's indexer: ReLU(q.k) weighted per head
                dsa_kernel_backend="none",  # megatron's torch path; it runs anywhere
                cp_comm_type="all_gather",  # under CP each rank gathers every key (the only way DSA runs)
            )
        return kwargs

    def _attention_parameters(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.q_head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def _indexer_parameters(self) -> int:
        """One layer's lightning indexer: query up-projection from the compressed query, a
        single key head (projection + LayerNorm with bias) and the per-head score weights."""
        h, heads, d = self.hidden_size, self.dsa_indexer_n_heads, self.dsa_indexer_head_dim
        return self.q_lora_rank * heads * d + h * d + 2 * d + h * heads

    def parameter_counts(self) -> dict[str, int]:
        """As ``MoEConfig``'s, plus (dsa) the indexers of all layers under ``indexer``."""
        counts = super().parameter_counts()
        if self.dsa:
            counts["indexer"] = self.num_layers * self._indexer_parameters()
        return counts

    def balance_flops_per_token(self, seq_length: int) -> float:
        """``flops_per_token`` with every query at its full ``dsa_indexer_topk`` keys (only a
        sequence's first ``dsa_indexer_topk`` queries see fewer), which is affine in the length, as
        the DP balancer's cost model needs; without DSA, ``flops_per_token``."""
        if not self.dsa:
            return self.flops_per_token(seq_length)
        sparse = self._attention_score_flops(seq_length, full_topk=True) - self._attention_score_flops(seq_length)
        return self.flops_per_token(seq_length) + sparse

    def _attention_score_flops(self, seq_length: int, full_topk: bool = False) -> float:
        if not self.dsa:
            # causal QK^T over q_head_dim and AV over v_head_dim: 3 * layers * seq * heads * (dqk + dv)
            return 3.0 * self.num_layers * seq_length * self.num_attention_heads * (self.q_head_dim + self.v_head_dim)
        # absorbed (MQA-form) attention over each query's selected keys: QK^T over kv_lora_rank +
        # qk_rope_head_dim, AV over kv_lora_rank; plus the indexer's causal scores over all keys
        k, s = self.dsa_indexer_topk, seq_length
        selected = (s * (s + 1) / 2 if k >= s else k * (k + 1) / 2 + (s - k) * k) / s  # keys per query
        if full_topk:
            selected = k
        attention = 6.0 * selected * self.num_attention_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        indexer = 3.0 * s * self.dsa_indexer_n_heads * self.dsa_indexer_head_dim
        return self.num_layers * (attention + indexer)
