"""Micro-batches of SFT samples: packed into one row (THD), or one padded row per sample.

``pack`` lays several samples end to end in one row of ``sum(lengths)`` positions. Each sample
keeps its own attention window: ``cu_seqlens`` (``[0, l0, l0+l1, ...]``, int32) marks where each
starts, the model receives them as megatron-core ``PackedSeqParams`` (``qkv_format="thd"``), and
``position_ids`` restart at 0 for every sample, as does RoPE (megatron applies it per
``cu_seqlens`` segment). With ``pad_to`` (pipeline parallelism needs one tensor shape for every
micro-batch) the row is filled up to that many positions by one more segment of pad tokens with
no loss.

``pad_rows`` is the unpacked layout of the same samples: one row each, right-padded to the
longest, with causal attention (pads come after every real token, so they change nothing) and no
loss on the pads. Both give the same per-token loss sum and the same gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

KEYS = ("tokens", "labels", "loss_mask")


def pack(samples: Sequence[dict], pad_to: int | None = None, pad_id: int = 0) -> dict:
    """One packed row ``[1, T]`` of ``samples`` (dicts of 1-d ``tokens``, ``labels``, ``loss_mask``)."""
    lengths = [len(s["tokens"]) for s in samples]
    total = sum(lengths)
    if pad_to is not None:
        if total > pad_to:
            raise ValueError(f"{len(samples)} samples of {total} positions do not fit in a row of {pad_to}")
        if total < pad_to:
            lengths.append(pad_to - total)
    row = {k: np.concatenate([np.asarray(s[k], dtype=np.int64) for s in samples]) for k in KEYS}
    if len(lengths) > len(samples):  # the pad segment
        pad = lengths[-1]
        row["tokens"] = np.concatenate([row["tokens"], np.full(pad, pad_id, dtype=np.int64)])
        row["labels"] = np.concatenate([row["labels"], np.full(pad, pad_id, dtype=np.int64)])
        row["loss_mask"] = np.concatenate([row["loss_mask"], np.zeros(pad, dtype=np.int64)])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
    out = {k: torch.from_numpy(v).unsqueeze(0) for k, v in row.items()}
    out["position_ids"] = torch.from_numpy(positions).unsqueeze(0)
    out["cu_seqlens"] = torch.from_numpy(cu.astype(np.int32))
    out["max_seqlen"] = int(max(lengths))
    return out


def pad_rows(samples: Sequence[dict], pad_id: int = 0) -> dict:
    """``[k, max length]`` rows, one per sample, right-padded (pads: ``pad_id``, no loss)."""
    width = max(len(s["tokens"]) for s in samples)
    out = {k: torch.full((len(samples), width), pad_id if k != "loss_mask" else 0, dtype=torch.int64) for k in KEYS}
    for r, s in enumerate(samples):
        n = len(s["tokens"])
        for k in KEYS:
            out[k][r, :n] = torch.as_tensor(np.asarray(s[k], dtype=np.int64))
    out["position_ids"] = torch.arange(width, dtype=torch.int64).expand(len(samples), width).contiguous()
    return out


def packed_seq_params(batch: dict):
    """megatron-core ``PackedSeqParams`` (THD) of a ``pack`` row, or None for ``pad_rows`` rows."""
    if "cu_seqlens" not in batch:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
