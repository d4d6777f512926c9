"""megatron's ``PackedSeqParams`` of one forward, carrying that forward's ``GatheredLayout``.

Every layer of a forward receives the same ``PackedSeqParams``, and the context-parallel attention
(``context_parallel_attention``) and DSA (``families.dsa``) need the same things of its padded
segment bounds in every layer: the bounds as numbers (a host read) and the order of the rows
gathered over the CP group. ``ForwardPackedSeqParams`` holds them in a ``GatheredLayout`` made with
the params, so the first layer computes them and the others reuse them; the next forward's params
start afresh.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.llm.layers.context_parallel_attention import GatheredLayout


@dataclasses.dataclass
class ForwardPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus ``layout``: the ``GatheredLayout`` of its padded bounds
    (``cu_seqlens_q_padded``, else ``cu_seqlens_q``), made with the params (``dataclasses.replace``
    makes a new one)."""

    layout: GatheredLayout = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        padded = self.cu_seqlens_q_padded
        self.layout = GatheredLayout(padded if padded is not None else self.cu_seqlens_q)


def forward_layout(params: PackedSeqParams, cu_seqlens_padded: torch.Tensor) -> GatheredLayout:
    """The layout of the packed row bounded by ``cu_seqlens_padded`` (``params``' padded bounds):
    the one ``params`` carries, shared by every layer of its forward; for params made elsewhere (a
    plain ``PackedSeqParams``) or bounds it does not carry, a new one that serves this call only."""
    layout = params.layout if isinstance(params, ForwardPackedSeqParams) else None
    if layout is None or layout.cu_seqlens_padded is not cu_seqlens_padded:
        return GatheredLayout(cu_seqlens_padded)
    return layout
