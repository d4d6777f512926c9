"""Micro-batches of SFT samples: packed into one row (THD), or one padded row per sample.

``pack`` lays several samples end to end in one row of ``sum(lengths)`` positions. Each sample
keeps its own attention window: ``cu_seqlens`` (``[0, l0, l0+l1, ...]``, int32) marks where each
starts, the model receives them as megatron-core ``PackedSeqParams`` (``qkv_format="thd"``), and
``position_ids`` restart at 0 for every sample, as does RoPE (megatron applies it per
``cu_seqlens`` segment). With ``pad_to`` (pipeline parallelism needs one tensor shape for every
micro-batch) the row is filled up to that many positions by one more segment of pad tokens with
no loss.

Under context parallelism (``pad_multiple=2*cp``) every sample's segment is padded at its end
to a multiple of ``pad_multiple`` positions (pad tokens, no loss; causal attention, so no real
token sees them), as megatron's THD context parallelism needs: ``cu_seqlens`` keeps the samples'
own bounds and ``cu_seqlens_padded`` the padded ones, which lay out the row (megatron's
``PackedSeqParams.cu_seqlens_q_padded``); positions count within the padded segment.
``cp_share`` then takes one CP rank's part of the row.

``pad_rows`` is the unpacked layout of the same samples: one row each, right-padded to the
longest, with causal attention (pads come after every real token, so they change nothing) and no
loss on the pads. Both give the same per-token loss sum and the same gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

KEYS = ("tokens", "labels", "loss_mask")


def padded_length(length: int, pad_multiple: int = 1) -> int:
    """``length`` rounded up to a multiple of ``pad_multiple``."""
    return -(-length // pad_multiple) * pad_multiple


def _padded(values: np.ndarray, n: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(n, fill, dtype=np.int64)]) if n else values


def pack(samples: Sequence[dict], pad_to: int | None = None, pad_id: int = 0, pad_multiple: int = 1) -> dict:
    """One packed row ``[1, T]`` of ``samples`` (dicts of 1-d ``tokens``, ``labels``, ``loss_mask``);
    ``pad_multiple > 1``: each sample padded to a multiple of it (``cu_seqlens_padded``)."""
    lengths = [len(s["tokens"]) for s in samples]
    padded = [padded_length(n, pad_multiple) for n in lengths]
    total = sum(padded)
    if pad_to is not None:
        if total > pad_to:
            raise ValueError(f"{len(samples)} samples of {total} positions do not fit in a row of {pad_to}")
        if pad_to % pad_multiple:
            raise ValueError(f"a row of {pad_to} positions is not a multiple of {pad_multiple}")
        if total < pad_to:  # the pad segment
            lengths.append(pad_to - total)
            padded.append(pad_to - total)
    fills = {"tokens": pad_id, "labels": pad_id, "loss_mask": 0}
    row = {k: [np.asarray(s[k], dtype=np.int64) for s in samples] for k in KEYS}
    if len(lengths) > len(samples):
        for k in KEYS:
            row[k].append(np.zeros(0, dtype=np.int64))
    row = {k: np.concatenate([_padded(v, p - len(v), fills[k]) for v, p in zip(parts, padded)])
           for k, parts in row.items()}
    cu_padded = np.concatenate([[0], np.cumsum(padded)])
    positions = np.arange(cu_padded[-1]) - np.repeat(cu_padded[:-1], padded)
    out = {k: torch.from_numpy(v).unsqueeze(0) for k, v in row.items()}
    out["position_ids"] = torch.from_numpy(positions).unsqueeze(0)
    out["cu_seqlens"] = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    out["max_seqlen"] = int(max(padded))
    if pad_multiple > 1:
        out["cu_seqlens_padded"] = torch.from_numpy(cu_padded.astype(np.int32))
    return out


def cp_share(row: dict, cp_size: int, cp_rank: int) -> dict:
    """CP rank ``cp_rank``'s share of a ``pack`` row made with ``pad_multiple=2*cp_size``: per
    segment its chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``tokens``, ``labels``,
    ``loss_mask`` and ``position_ids`` (``layers.context_parallel_attention.thd_zigzag_index``);
    the ``cu_seqlens`` stay the whole row's."""
    from loongforge.llm.layers.context_parallel_attention import thd_zigzag_index

    if "cu_seqlens_padded" not in row:
        raise ValueError("cp_share: the row has no cu_seqlens_padded (pack it with pad_multiple=2*cp)")
    index = thd_zigzag_index(row["cu_seqlens_padded"], cp_size, cp_rank)
    return {k: (v.index_select(1, index) if k in (*KEYS, "position_ids") else v) for k, v in row.items()}


def pad_rows(samples: Sequence[dict], pad_id: int = 0, pad_multiple: int = 1) -> dict:
    """``[k, max length]`` rows, one per sample, right-padded (pads: ``pad_id``, no loss); the
    width rounded up to a multiple of ``pad_multiple``."""
    width = padded_length(max(len(s["tokens"]) for s in samples), pad_multiple)
    out = {k: torch.full((len(samples), width), pad_id if k != "loss_mask" else 0, dtype=torch.int64) for k in KEYS}
    for r, s in enumerate(samples):
        n = len(s["tokens"])
        for k in KEYS:
            out[k][r, :n] = torch.as_tensor(np.asarray(s[k], dtype=np.int64))
    out["position_ids"] = torch.arange(width, dtype=torch.int64).expand(len(samples), width).contiguous()
    return out


def packed_seq_params(batch: dict):
    """megatron-core ``PackedSeqParams`` (THD) of a ``pack`` row, or None for ``pad_rows`` rows; one
    per forward, carrying the layout its layers share (``layers.packed_params``)."""
    if "cu_seqlens" not in batch:
        return None
    from loongforge.llm.layers.packed_params import ForwardPackedSeqParams

    cu, padded = batch["cu_seqlens"], batch.get("cu_seqlens_padded")
    return ForwardPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                                  cu_seqlens_kv_padded=padded, max_seqlen_q=batch["max_seqlen"],
                                  max_seqlen_kv=batch["max_seqlen"])
