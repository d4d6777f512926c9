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

Under tensor parallelism each rank holds whole key heads and the value heads they serve
(``gated_delta_net_tp.HeadShards``), as megatron's attention holds whole query groups: the input
projections are column-parallel (the input copied to every TP rank, or all-gathered over the
sequence under sequence parallelism), the convolution is split by channel with its weight, the
delta rule and the gated RMSNorm run per local head without communication (the norm's weight, one
per head dimension and shared by every head, gets its gradient summed over TP), and the output
projection is megatron's ``RowParallelLinear`` (all-reduce, or reduce-scatter under sequence
parallelism) with its weight gradient added into ``main_grad`` by its GEMM inside the engine's
schedule (``MainGradRowParallelLinear``, as the attention layers' linears). With context parallelism too, the state hand-overs run per TP rank over its CP group.
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


class Weight(torch.nn.Module):
    """A module holding one ``weight`` (this TP rank's shard of it), so that the DeltaNet's
    projections and convolution keep Hugging Face's ``<name>.weight`` names."""

    def __init__(self, shape: tuple[int, ...], dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype))


class GatedDeltaNet(MegatronModule):
    """``num_key_heads``/``num_value_heads``/``key_head_dim``/``value_head_dim``/``conv_kernel``:
    the DeltaNet's shape (``Qwen35Config``'s ``linear_*`` fields); ``kernels``: the policy its
    ``gated_delta_rule`` is resolved by. ``num_key_heads``/``num_value_heads`` hold this TP rank's
    heads once built (``shards`` the whole shape)."""

    def __init__(self, config, layer_number: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, kernels: KernelPolicy = KernelPolicy(), pg_collection=None,
                 **_megatron_options):
        super().__init__(config=config)
        from loongforge.llm.layers.gated_delta_net_tp import HeadShards
        from loongforge.llm.layers.main_grad_linear import MainGradRowParallelLinear

        self.layer_number = layer_number
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        tp_group = pg_collection.tp if pg_collection is not None else None
        tp = tp_group.size() if tp_group is not None else 1
        self.tp_group = tp_group
        self.tensor_parallel = tp > 1
        self.shards = HeadShards(num_key_heads, num_value_heads, key_head_dim, value_head_dim, tp,
                                 tp_group.rank() if tp_group is not None else 0)
        self.num_key_heads, self.num_value_heads = self.shards.local_key_heads, self.shards.local_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.eps = config.layernorm_epsilon
        h, dtype = config.hidden_size, config.params_dtype
        shards = self.shards
        self.in_proj_qkv = Weight((shards.local_rows(shards.qkv_sections), h), dtype)
        self.in_proj_z = Weight((shards.local_rows(shards.value_sections), h), dtype)
        self.in_proj_b = Weight((self.num_value_heads, h), dtype)
        self.in_proj_a = Weight((self.num_value_heads, h), dtype)
        self.conv1d = Weight((shards.local_rows(shards.qkv_sections), 1, conv_kernel), dtype)
        self.dt_bias = torch.nn.Parameter(torch.empty(self.num_value_heads, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.num_value_heads, dtype=dtype))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(value_head_dim, dtype=dtype))
        self._initialise(config)
        self.out_proj = MainGradRowParallelLinear(num_value_heads * value_head_dim, h, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)
        self._rule = kernels.get("gated_delta_rule")

    def split_parameters(self) -> tuple[tuple[str, torch.nn.Parameter, tuple[int, ...]], ...]:
        """``(name, parameter, whole sections)`` of every parameter TP splits along its first axis
        (all but ``out_proj``, split along its second by megatron, and the replicated ``norm``)."""
        s = self.shards
        return (("in_proj_qkv.weight", self.in_proj_qkv.weight, s.qkv_sections),
                ("in_proj_z.weight", self.in_proj_z.weight, s.value_sections),
                ("in_proj_b.weight", self.in_proj_b.weight, s.head_sections),
                ("in_proj_a.weight", self.in_proj_a.weight, s.head_sections),
                ("conv1d.weight", self.conv1d.weight, s.qkv_sections),
                ("dt_bias", self.dt_bias, s.head_sections), ("A_log", self.A_log, s.head_sections))

    @torch.no_grad()
    def _initialise(self, config) -> None:
        """Each split parameter drawn whole (fp32, in a fixed order), then this rank's shard of it
        kept: every TP size starts from the same weights. The projections follow
        ``config.init_method`` (where ``perform_initialization``), the convolution PyTorch's
        ``Conv1d`` default, the decay rates ``exp(A_log)`` start in [0.01, 16] and ``dt_bias`` at 1,
        as Hugging Face initialises them."""
        import math

        whole = {name: torch.empty(sum(sections), *param.shape[1:], dtype=torch.float32)
                 for name, param, sections in self.split_parameters()}
        projections = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
        if config.perform_initialization:
            for name in projections:
                config.init_method(whole[name])
        torch.nn.init.kaiming_uniform_(whole["conv1d.weight"], a=math.sqrt(5))
        whole["A_log"].uniform_(0.01, 16).log_()
        whole["dt_bias"].fill_(1.0)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for name, param, sections in self.split_parameters():
            if name not in projections or config.perform_initialization:
                param.copy_(self.shards.shard(whole[name], sections))
            # split over TP at every TP size (as megatron marks its parallel linears' weights)
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's default (``out_proj`` row-parallel, the rest replicated), the TP-split
        parameters described by ``HeadShards`` (their whole tensors in checkpoints)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, _, sections in self.split_parameters():
            out[prefix + name] = self.shards.sharded_tensor(out[prefix + name], sections, len(sharded_offsets))
        return out

    @property
    def conv_taps(self) -> int:
        return self.conv1d.weight.shape[-1]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_unused):
        if attention_mask is not None:
            raise ValueError("GatedDeltaNet: an explicit attention mask is not supported (causal, packed rows by cu_seqlens)")
        if self.tensor_parallel:  # column-parallel input projections: every rank reads every token
            from megatron.core.tensor_parallel import mappings

            hidden_states = (mappings.gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
                             if self.config.sequence_parallel else
                             mappings.copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group))
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
        return self.out_proj(self.output(o, features["z"]).transpose(0, 1))[0], None

    def features(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-token inputs of the mixer, from the layer input ``x`` ``[b, s, h]``."""
        b, s, _ = x.shape
        return {
            "qkv": F.linear(x, self.in_proj_qkv.weight),
            "z": F.linear(x, self.in_proj_z.weight).view(b, s, self.num_value_heads, self.value_head_dim),
            "beta": torch.sigmoid(F.linear(x, self.in_proj_b.weight)),
            "g": -self.A_log.float().exp() * F.softplus(F.linear(x, self.in_proj_a.weight).float()
                                                        + self.dt_bias.float()),
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
        """The gated RMSNorm per (local) value head: ``[b, s, Hv Dv]``, the output projection's input."""
        b, s = o.shape[:2]
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        weight = self.norm.weight
        if self.tensor_parallel:  # shared by every head: each rank's heads add to its gradient
            from megatron.core.tensor_parallel import mappings

            weight = mappings.copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        gated = (weight * normed) * F.silu(z.float())
        return gated.to(o.dtype).reshape(b, s, -1)
