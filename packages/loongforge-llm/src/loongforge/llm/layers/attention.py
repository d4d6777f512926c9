"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``, as a megatron-core submodule.

``SDPAttention`` fills the ``core_attention`` slot of megatron's ``SelfAttention`` (the slot
``DotProductAttention`` fills in megatron's local spec) without materialising the
``[b, heads, s, s]`` scores: on a GPU, SDPA runs a flash / cuDNN / memory-efficient kernel. Grouped
query attention hands SDPA the ``num_query_groups`` key/value heads as they are
(``enable_gqa``), so no repeated K/V is built. Packed sequences (``PackedSeqParams`` with
``qkv_format="thd"``) attend only within their ``cu_seqlens`` segment: through flash-attention's
variable-length kernel (``torch.nn.attention.varlen``) on CUDA, otherwise one SDPA call per
segment.

Layouts are megatron's: dense ``query`` is ``[sq, b, heads, head_dim]`` and the result
``[sq, b, heads * head_dim]``; packed ``query`` is ``[t, heads, head_dim]`` and the result
``[t, heads * head_dim]``, ``head_dim`` being the values' (MLA pads its values to the query
head dim for packed batches, and cuts the output back itself). A given ``attention_mask`` follows megatron's convention (``True`` =
masked out, broadcastable to ``[b, 1, sq, sk]``).

With ``context_parallel_size > 1`` the inputs are this CP rank's share of every sequence (see
``context_parallel_attention``: megatron's causal load-balanced split; packed rows split segment
by segment, ``cu_seqlens_q_padded`` holding the whole row's padded bounds) and the attention runs
over the whole sequences: K/V all-gathered over the CP group (megatron's ``cp_comm_type``
``"all_gather"``; other comm types are refused), causal only, no explicit ``attention_mask``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def sdpa_backends(backend: AttnBackend):
    """SDPA backends for megatron's ``attention_backend`` (``auto``: let SDPA pick)."""
    from torch.nn.attention import SDPBackend

    return {
        AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
        AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
        AttnBackend.unfused: [SDPBackend.MATH],
    }.get(backend)


def causal_mask(mask, causal: bool, sq: int, sk: int):
    """SDPA's ``(attn_mask, is_causal)`` for ``mask`` (True = attend) or causal attention. Causal
    attention of fewer queries than keys aligns the queries with the last keys (they are the end
    of the sequence: a later chunk under context parallelism or ChunkPipe): torch's lower-right
    causal bias, which the flash and memory-efficient kernels take without a materialised mask."""
    if not causal or mask is not None:
        return mask, False
    if sq == sk:
        return None, True
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(sq, sk), False


def _varlen_attn():
    """torch's variable-length flash attention, where this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def packed_bounds(params, cu_q: torch.Tensor, cu_kv: torch.Tensor) -> tuple[list[int], list[int]]:
    """The query and key segment bounds of a packed row as numbers: read back once per forward
    from its layout (``packed_params.forward_layout``) when they are one tensor, else each here."""
    from loongforge.llm.layers.packed_params import forward_layout

    bounds_q = forward_layout(params, cu_q).bounds()
    return bounds_q, bounds_q if cu_kv is cu_q else cu_kv.tolist()


class SDPAttention(MegatronModule):
    """megatron-core core attention computed by ``scaled_dot_product_attention`` (see module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.window_size is not None:
            raise ValueError(f"SDPAttention: sliding-window attention (window_size={config.window_size}) is not supported")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported (only 'vanilla')")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        self.cp_group = getattr(pg_collection, "cp", None)
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if cp != config.context_parallel_size:
            raise ValueError(f"SDPAttention: context_parallel_size={config.context_parallel_size} but the CP group "
                             f"has {cp} ranks")
        if cp > 1:
            from loongforge.core.config import ConfigError

            if attn_mask_type not in _CAUSAL:
                raise ConfigError(f"parallel.cp={cp}: context parallelism in SDPAttention is causal only "
                                  f"(attn_mask_type={attn_mask_type.name})")
            if cp_comm_type not in (None, "all_gather"):
                raise ConfigError(f"parallel.cp={cp}: SDPAttention implements cp_comm_type 'all_gather' only, "
                                  f"not {cp_comm_type!r}")
        self.cp = cp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backends = sdpa_backends(config.attention_backend)

    def _sdpa(self, q, k, v, mask, causal: bool, dropout_p: float):
        """SDPA on ``[b, heads, s, d]`` views, under the configured backends."""
        mask, causal = causal_mask(mask, causal, q.shape[-2], k.shape[-2])
        kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                      scale=self.softmax_scale, enable_gqa=self.num_heads != self.num_groups)
        if self.backends is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        dropout_p = self.dropout_p if self.training else 0.0
        if self.cp > 1:
            return self._context_parallel(query, key, value, attention_mask, mask_type, packed_seq_params, dropout_p)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, causal, dropout_p)
        if packed_seq_params is not None and packed_seq_params.qkv_format not in (None, "sbhd"):
            raise ValueError(f"SDPAttention: qkv_format={packed_seq_params.qkv_format!r}; expected 'thd' or 'sbhd'")

        sq, b = query.shape[:2]
        mask = None
        if attention_mask is not None:  # used as given, like megatron's local attention does
            mask = ~attention_mask.to(torch.bool)  # megatron: True = masked out; SDPA: True = attend
            if mask_type == AttnMaskType.padding_causal:
                mask = mask & torch.ones(sq, key.shape[0], dtype=torch.bool, device=mask.device).tril()
        out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                         mask, causal, dropout_p)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, params, causal: bool, dropout_p: float):
        """Attention over THD-packed sequences: each ``cu_seqlens`` segment attends only to itself."""
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_q is None or cu_kv is None:
            raise ValueError("SDPAttention: THD input needs cu_seqlens_q and cu_seqlens_kv in packed_seq_params")
        t = query.shape[0]
        if cu_q.numel() != cu_kv.numel():
            raise ValueError(f"SDPAttention: cu_seqlens_q has {cu_q.numel()} entries, cu_seqlens_kv {cu_kv.numel()}")
        varlen = _varlen_attn()
        if varlen is not None and query.is_cuda and dropout_p == 0.0 and query.dtype in (torch.float16, torch.bfloat16):
            # flash varlen leaves tokens outside every segment unwritten; the caller's cu_seqlens cover the row
            max_q = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
            max_kv = params.max_seqlen_kv or int((cu_kv[1:] - cu_kv[:-1]).max())
            out = varlen(query, key, value, cu_q.to(torch.int32), cu_kv.to(torch.int32), int(max_q), int(max_kv),
                         scale=self.softmax_scale, window_size=(-1, 0) if causal else (-1, -1))
            return out.reshape(t, -1)
        bounds_q, bounds_kv = packed_bounds(params, cu_q, cu_kv)
        if bounds_q[0] != 0 or bounds_q[-1] != t:
            raise ValueError(f"SDPAttention: cu_seqlens_q {bounds_q} must run from 0 to the {t} packed tokens")
        pieces = []
        for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_kv[:-1], bounds_kv[1:]):
            if q1 == q0:
                continue
            seg = self._sdpa(query[q0:q1].transpose(0, 1)[None], key[k0:k1].transpose(0, 1)[None],
                             value[k0:k1].transpose(0, 1)[None], None, causal, dropout_p)
            pieces.append(seg[0].transpose(0, 1))
        return torch.cat(pieces, dim=0).reshape(t, -1)

    def _context_parallel(self, query, key, value, attention_mask, mask_type, params, dropout_p: float):
        """Causal attention of this CP rank's tokens over the CP group's whole sequences."""
        from loongforge.llm.layers.context_parallel_attention import GatheredLayout, context_parallel_attention
        from loongforge.llm.layers.packed_params import forward_layout

        if attention_mask is not None:
            raise ValueError("SDPAttention: an explicit attention_mask is not supported with context parallelism")
        if mask_type not in _CAUSAL:
            raise ValueError(f"SDPAttention: context parallelism is causal only (attn_mask_type={mask_type.name})")

        def sdpa(q, k, v, mask, causal):
            return self._sdpa(q, k, v, mask, causal, dropout_p)

        if params is not None and params.qkv_format == "thd":
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
            if cu is None or (cu_kv is not None and cu_kv is not cu and not torch.equal(cu, cu_kv)):
                raise ValueError("SDPAttention: context parallelism needs the same padded cu_seqlens for queries "
                                 "and keys in packed_seq_params")
            out = context_parallel_attention(sdpa, query, key, value, self.cp_group, forward_layout(params, cu))
            return out.reshape(out.shape[0], -1)
        if params is not None and params.qkv_format not in (None, "sbhd"):
            raise ValueError(f"SDPAttention: qkv_format={params.qkv_format!r}; expected 'thd' or 'sbhd'")
        out = context_parallel_attention(sdpa, query, key, value, self.cp_group, GatheredLayout())
        return out.reshape(out.shape[0], out.shape[1], -1)
