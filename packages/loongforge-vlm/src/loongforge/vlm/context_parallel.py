"""Context parallelism (``parallel.cp > 1``) of the VLM's foundation.

Every CP rank of a DP replica collates the same micro-batch: one THD row (``data.packing.pack_thd``)
whose samples are each padded to a multiple of ``2*cp`` positions. The CP ranks share out the
micro-batch's images, encode their shares and all-gather the features (``VisionLanguageModel.
encode_vision``, ``loongforge.vlm.parallel``), and the model scatters them into the embeddings
of the whole row; then each rank keeps its share of the row (``cp_index``: per sample,
chunks ``r`` and ``2*cp-1-r`` of ``2*cp``, loongforge-llm's ``thd_zigzag_index``, megatron's
load-balanced split) of the embeddings and the DeepStack additions. The labels, the loss mask and
the positions are split here, in the collate, by the same index, so the multimodal RoPE angles
the foundation computes from the positions are those of this rank's tokens. The foundation's
attention (loongforge-llm's ``FusedSelfAttention`` on ``SDPAttention``) all-gathers the keys and
values of the CP group and attends over each whole sample; the loss is summed over local tokens
and megatron reduces the gradients over DP x CP. Under pipeline parallelism every stage collates
and splits the row the same way, each in its own CP group (``loongforge.vlm.pipeline``).
"""

from __future__ import annotations

import torch

SPLIT = ("labels", "loss_mask")  # [1, T] entries split along the row; position_ids along its last dim


def cp_row_share(row: dict, cp_size: int, cp_rank: int) -> dict:
    """CP rank ``cp_rank``'s share of a ``pack_thd`` row made with ``pad_multiple=2*cp_size``:
    ``cp_index`` (the row positions of its tokens), and ``labels``, ``loss_mask`` and
    ``position_ids`` at those positions; ``tokens`` and the media stay whole (the model embeds the
    whole row, then keeps its share)."""
    from loongforge.llm.api import thd_zigzag_index

    if "cu_seqlens_padded" not in row:
        raise ValueError("cp_row_share: the row has no cu_seqlens_padded (pack_thd with pad_multiple=2*cp)")
    index = thd_zigzag_index(row["cu_seqlens_padded"], cp_size, cp_rank)
    out = {k: (v.index_select(1, index) if k in SPLIT else v) for k, v in row.items()}
    out["position_ids"] = row["position_ids"].index_select(row["position_ids"].dim() - 1, index)
    out["cp_index"] = index
    return out


def collate_cp_share(cp_size: int, cp_rank: int, samples) -> dict:
    """``samples`` packed as a THD row padded for ``cp_size`` CP ranks, then rank ``cp_rank``'s share."""
    from loongforge.vlm.data.packing import pack_thd

    return cp_row_share(pack_thd(samples, pad_multiple=2 * cp_size), cp_size, cp_rank)


def local_rows(hidden: torch.Tensor, cp_index: torch.Tensor | None) -> torch.Tensor:
    """This rank's rows (dim 0, ``[s, b, h]``) of a whole row's tensor; all of it without CP."""
    return hidden if cp_index is None else hidden.index_select(0, cp_index.to(hidden.device))


def check_foundation_layers(foundation, cp: int) -> None:
    """Refuse (before any process group) a foundation whose layers do not attend through
    loongforge-llm's ``FusedSelfAttention`` (``foundation_attention``), the layer that takes
    per-token multimodal RoPE angles and the THD rows' CP split (megatron's own ``SelfAttention``,
    as the MoE families and Transformer Engine's layer use, re-slices the angles per segment or
    per CP rank)."""
    from loongforge.vlm.foundation_attention import foundation_attention, on_fast_layer

    if not on_fast_layer(foundation):
        raise ValueError(f"parallel.cp={cp}: the VLM's context parallelism needs the foundation on loongforge-llm's "
                         f"fast layer (FusedSelfAttention); foundation.family={foundation.family!r} attends through "
                         f"{getattr(foundation_attention(foundation), '__name__', None)} here")
