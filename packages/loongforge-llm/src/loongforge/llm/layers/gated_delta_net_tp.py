"""Tensor parallelism for ``GatedDeltaNet``: which heads, rows and channels a TP rank holds.

TP rank ``r`` of ``tp`` holds key heads ``[r Hk/tp, (r + 1) Hk/tp)`` and the value heads they serve
(value heads ``[r Hv/tp, (r + 1) Hv/tp)``: each key head serves ``Hv / Hk`` consecutive value
heads), so the delta rule runs on local heads without communication. The tensors are stored (in
checkpoints, and in Hugging Face's layout) whole; along their first axis they are made of
*sections*, each split evenly over TP:

    in_proj_qkv.weight, conv1d.weight   [q (Hk Dk); k (Hk Dk); v (Hv Dv)]   three sections
    in_proj_z.weight                    [Hv Dv]                             one section
    in_proj_b.weight, in_proj_a.weight,
    dt_bias, A_log                      [Hv]                                one section

A rank holds, per section, its ``1/tp`` slice, the slices side by side. ``out_proj`` is megatron's
``RowParallelLinear`` (split along its input axis), ``norm.weight`` (``[Dv]``, one per head) is
replicated. ``shard`` cuts a rank's rows out of a whole tensor (the weights are initialised whole,
then sharded, so every TP size starts from the same weights); ``sharded_tensor`` describes them to
megatron's sharded state dict (a ``ShardedTensorFactory`` where there are several sections, as
megatron's SwiGLU ``linear_fc1`` does for its two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShards:
    """TP rank ``rank`` of ``tp``'s share of a Gated DeltaNet with the given whole shape."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    tp: int = 1
    rank: int = 0

    def __post_init__(self):
        from loongforge.core.config import ConfigError

        for key, heads in (("model.linear_num_key_heads", self.num_key_heads),
                           ("model.linear_num_value_heads", self.num_value_heads)):
            if heads % self.tp:
                raise ConfigError(f"{key}={heads} must be divisible by parallel.tp={self.tp}: each tensor-parallel "
                                  "rank holds whole Gated DeltaNet heads")

    @property
    def local_key_heads(self) -> int:
        return self.num_key_heads // self.tp

    @property
    def local_value_heads(self) -> int:
        return self.num_value_heads // self.tp

    @property
    def qkv_sections(self) -> tuple[int, int, int]:
        """The whole sections of ``in_proj_qkv``'s rows and ``conv1d``'s channels: q, k, v."""
        qk = self.num_key_heads * self.key_head_dim
        return qk, qk, self.num_value_heads * self.value_head_dim

    @property
    def value_sections(self) -> tuple[int]:
        """``in_proj_z``'s rows: one section of every value head's channels."""
        return (self.num_value_heads * self.value_head_dim,)

    @property
    def head_sections(self) -> tuple[int]:
        """``in_proj_b``/``in_proj_a``'s rows, ``dt_bias`` and ``A_log``: one entry per value head."""
        return (self.num_value_heads,)

    def local_rows(self, sections: tuple[int, ...]) -> int:
        return sum(sections) // self.tp

    def shard(self, whole: torch.Tensor, sections: tuple[int, ...]) -> torch.Tensor:
        """This rank's rows of ``whole`` (first axis made of ``sections``), side by side."""
        if whole.shape[0] != sum(sections):
            raise ValueError(f"HeadShards.shard: {whole.shape[0]} rows, expected sections {sections}")
        return torch.cat([part.chunk(self.tp)[self.rank] for part in whole.split(list(sections))])

    def sharded_tensor(self, replicated, sections: tuple[int, ...], prepend_axis_num: int):
        """The TP-split form of ``replicated`` (the ``ShardedTensor`` megatron's default sharded state
        dict made of this rank's tensor as if every rank held it whole): its sections' regions of
        the whole tensor, each shard a primary copy on TP rank ``rank`` (the TP entry of its
        replica id 0)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        replica_id = (replicated.replica_id[0], 0, *replicated.replica_id[2:])
        prefix_shape = tuple(replicated.global_shape[:prepend_axis_num])
        prefix_offset = tuple(replicated.global_offset[:prepend_axis_num])
        local_sizes = [size // self.tp for size in sections]

        def regions(key: str, t: torch.Tensor, replica, flattened_range=None) -> list:
            if flattened_range is not None:
                raise ValueError(f"{key}: flattened Gated DeltaNet shards are not supported")
            # one section: the tensor itself (megatron's optimizer finds a parameter's entry by identity)
            parts = t.split(local_sizes) if len(sections) > 1 else (t,)
            out, start = [], 0
            for whole, part in zip(sections, parts):
                out.append(ShardedTensor(
                    key, part, part.dtype, tuple(part.shape), prefix_shape + (sum(sections), *part.shape[1:]),
                    prefix_offset + (start + self.rank * part.shape[0],) + (0,) * (part.dim() - 1),
                    None, replica, prepend_axis_num))
                start += whole
            return out

        if len(sections) == 1:
            return regions(replicated.key, replicated.data, replica_id)[0]
        return ShardedTensorFactory(replicated.key, replicated.data, regions, lambda parts: torch.cat(parts),
                                    replica_id)
