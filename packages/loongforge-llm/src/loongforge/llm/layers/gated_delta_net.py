"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5, as a megatron-core submodule.

It fills the ``self_attention`` slot of a megatron ``TransformerLayer`` (input ``[s, b, h]``,
returns ``(output, None)``), with the parameters of Hugging Face's ``Qwen3_5GatedDeltaNet``
under the same names::

    q, k, v = split(silu(short_causal_conv(in_proj_qkv(x))))     per-channel conv, K taps
    beta    = sigmoid(in_proj_b(x))                               per value head
    g       = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)      log decay, per value head
    o       = gated_delta_rule(q, k, v, g, beta)                  the registry op
    out     = out_proj(rms_norm(o) * norm.weight * silu(in_proj_z(x)))   per value head

Packed rows (``PackedSeqParams`` with ``qkv_format="thd"``) keep their sequences apart: the
convolution reads no token of an earlier sequence and the delta rule's state restarts at every
``cu_seqlens`` bound (``cu_seqlens_q_padded`` where given: the padding after a sequence belongs
to it). Bounds that do not rise from 0 to the row's length are refused by name.

Under context parallelism each rank holds megatron's load-balanced share of every sequence: chunks
``r`` and ``2 cp - 1 - r`` of ``2 cp`` (of every packed sequence, for a packed row).
``context_parallel_delta_net`` runs them in sequence order, each chunk starting from the state (and
the convolution's last inputs) of the chunk before it, handed over from the rank that ran it.
Tensor parallelism is not supported (refused when built).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from loongforge.core.kernels import KernelPolicy


def sequence_positions(bounds: list[int], device) -> torch.Tensor:
    """``[T]``: each token's index within its own sequence of a packed row with ``bounds``."""
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    return torch.cat([torch.arange(n, device=device) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)


def checked_bounds(cu_seqlens: torch.Tensor, tokens: int, what: str = "cu_seqlens") -> list[int]:
    """``cu_seqlens`` as numbers, refused (``ValueError`` naming it) unless it rises from 0 to ``tokens``."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tokens or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"GatedDeltaNet: {what}={bounds} must rise from 0 to the packed row's {tokens} tokens")
    return bounds


class GatedDeltaNet(MegatronModule):
    """``num_key_heads``/``num_value_heads``/``key_head_dim``/``value_head_dim``/``conv_kernel``:
    the DeltaNet's shape (``Qwen35Config``'s ``linear_*`` fields); ``kernels``: the policy its
    ``gated_delta_rule`` is resolved by."""

    def __init__(self, config, layer_number: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, kernels: KernelPolicy = KernelPolicy(), pg_collection=None,
                 **_megatron_options):
        super().__init__(config=config)
        if pg_collection is not None and pg_collection.tp.size() > 1:
            from loongforge.core.config import ConfigError

            raise ConfigError(f"parallel.tp={pg_collection.tp.size()}: Gated DeltaNet layers run without tensor parallelism")
        self.layer_number = layer_number
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.eps = config.layernorm_epsilon
        h, qk, v = config.hidden_size, num_key_heads * key_head_dim, num_value_heads * value_head_dim
        dtype = config.params_dtype
        linear = lambda n_in, n_out: torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype)  # noqa: E731
        self.in_proj_qkv = linear(h, 2 * qk + v)
        self.in_proj_z = linear(h, v)
        self.in_proj_b = linear(h, num_value_heads)
        self.in_proj_a = linear(h, num_value_heads)
        self.conv1d = torch.nn.Conv1d(2 * qk + v, 2 * qk + v, conv_kernel, groups=2 * qk + v, bias=False, dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(num_value_heads, dtype=dtype))
        # the decay rates exp(A_log) start in [0.01, 16], as Hugging Face initialises them
        self.A_log = torch.nn.Parameter(torch.empty(num_value_heads, dtype=dtype).uniform_(0.01, 16).log_())
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(value_head_dim, dtype=dtype))
        self.out_proj = linear(v, h)
        if config.perform_initialization:
            for proj in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
                config.init_method(proj.weight)
            config.output_layer_init_method(self.out_proj.weight)
        self._rule = kernels.get("gated_delta_rule")

    @property
    def conv_taps(self) -> int:
        return self.conv1d.weight.shape[-1]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_unused):
        if attention_mask is not None:
            raise ValueError("GatedDeltaNet: an explicit attention mask is not supported (causal, packed rows by cu_seqlens)")
        x = hidden_states.transpose(0, 1)  # [b, s, h]
        b, s, _ = x.shape
        bounds = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            cp = self.cp_group.size() if self.cp_group is not None else 1
            bounds = checked_bounds(cu, s * cp, "cu_seqlens_q_padded" if packed_seq_params.cu_seqlens_q_padded
                                    is not None else "cu_seqlens_q")
            if b != 1:
                raise ValueError(f"GatedDeltaNet: a packed (thd) batch is one row, got {b}")
        features = self.features(x)
        if self.cp_group is not None and self.cp_group.size() > 1:
            from loongforge.llm.layers.gated_delta_net_cp import context_parallel_delta_net

            o = context_parallel_delta_net(self, features, bounds)
        else:
            whole = bounds if bounds is not None else [0, s]
            positions = sequence_positions(whole, x.device).expand(b, s)
            o = self.mix(features, positions, None, None if bounds is None else torch.tensor(bounds, device=x.device),
                         None)[0]
        return self.output(o, features["z"]).transpose(0, 1), None

    def features(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-token inputs of the mixer, from the layer input ``x`` ``[b, s, h]``."""
        b, s, _ = x.shape
        return {
            "qkv": self.in_proj_qkv(x),
            "z": self.in_proj_z(x).view(b, s, self.num_value_heads, self.value_head_dim),
            "beta": torch.sigmoid(self.in_proj_b(x)),
            "g": -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()),
        }

    def mix(self, features: dict, positions: torch.Tensor, history: torch.Tensor | None,
            cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None):
        """``(o [b, s, Hv, Dv], final_state)`` of the convolution and the delta rule over tokens at
        ``positions`` within their sequences, after ``history`` (the convolution's inputs just
        before) and ``initial_state`` (the rule's state, one per sequence)."""
        return self.rule(self.conv(features["qkv"], positions, history), features["g"], features["beta"], cu_seqlens,
                         initial_state)

    def conv(self, qkv: torch.Tensor, positions: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
        """The short causal convolution and SiLU over ``qkv`` ``[b, s, C]`` (``short_causal_conv``)."""
        from loongforge.llm.ops.gated_delta_rule import short_causal_conv

        return short_causal_conv(qkv, self.conv1d.weight[:, 0], positions, history)

    def rule(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None,
             initial_state: torch.Tensor | None):
        """The registry's ``gated_delta_rule`` on the convolved ``mixed`` ``[b, s, C]`` split into heads."""
        b, s, _ = mixed.shape
        qk = self.num_key_heads * self.key_head_dim
        q, k, v = mixed.split([qk, qk, mixed.shape[-1] - 2 * qk], dim=-1)
        q = q.reshape(b, s, self.num_key_heads, self.key_head_dim)
        k = k.reshape(b, s, self.num_key_heads, self.key_head_dim)
        v = v.reshape(b, s, self.num_value_heads, self.value_head_dim)
        return self._rule(q, k, v, g, beta.to(v.dtype), cu_seqlens, initial_state)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm per value head and the output projection: ``[b, s, h]``."""
        b, s = o.shape[:2]
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        gated = (self.norm.weight * normed) * F.silu(z.float())
        return self.out_proj(gated.to(o.dtype).reshape(b, s, -1))
