"""One micro-batch: several samples packed end to end into one row.

Each sample attends only to itself. ``pack`` gives the row a boolean ``attention_mask [1, 1, T, T]``
(True: masked) when it holds more than one sample, causal within each sample and blocking
attention across samples; megatron's local attention reads it directly. ``pack_thd`` lays the
same row out as THD instead (loongforge-llm's ``data.packing.pack``: ``cu_seqlens`` marking each
sample's segment, handed to the foundation as megatron's ``PackedSeqParams``), with no ``T x T``
mask; with ``pad_multiple`` (``2*cp`` under context parallelism) every sample is padded at its end
to a multiple of it (pad tokens, no loss, ``cu_seqlens_padded``), as the CP split needs.

Positions restart for every sample (multimodal RoPE positions are per sample and the foundation's
rotary angles are computed per token from them; with 1D RoPE the positions count within each
segment under THD and run on with the dense mask, which changes nothing within a sample since
RoPE scores depend on position differences only). Pad tokens take position 0. The samples' media
are concatenated in order, so the placeholder tokens of the row and the vision tokens of
``pixel_values`` line up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def document_causal_mask(lengths: Sequence[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is not allowed."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))
    total = doc.numel()
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(causal & (doc[:, None] == doc[None, :]))[None, None]


def _media(samples: Sequence[dict]) -> dict:
    return {"pixel_values": torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples]).astype(np.float32)),
            "grid_thw": torch.from_numpy(np.concatenate([s["grid_thw"] for s in samples]))}


def _positions(samples: Sequence[dict], padded: Sequence[int]) -> torch.Tensor:
    """The samples' positions end to end, each sample's run zero-filled up to its padded length:
    ``[3, 1, T]`` (mrope) or ``[1, T]``."""
    parts = []
    for s, width in zip(samples, padded):
        p = np.asarray(s["position_ids"], dtype=np.int64)
        fill = np.zeros((*p.shape[:-1], width - p.shape[-1]), dtype=np.int64)
        parts.append(np.concatenate([p, fill], axis=-1))
    joined = torch.from_numpy(np.concatenate(parts, axis=-1))
    return joined.unsqueeze(1) if joined.dim() == 2 else joined.unsqueeze(0)


def pack(samples: Sequence[dict]) -> dict:
    """The packed micro-batch of ``samples`` (items of ``VLMDataset``), with a dense document-causal mask."""
    lengths = [len(s["tokens"]) for s in samples]
    row = {k: torch.from_numpy(np.concatenate([s[k] for s in samples])).unsqueeze(0)
           for k in ("tokens", "labels", "loss_mask")}
    row["position_ids"] = _positions(samples, lengths)
    row["attention_mask"] = document_causal_mask(lengths) if len(samples) > 1 else None
    return {**row, **_media(samples)}


def pack_thd(samples: Sequence[dict], pad_multiple: int = 1) -> dict:
    """The packed micro-batch of ``samples`` as a THD row (``cu_seqlens``, ``max_seqlen``, and with
    ``pad_multiple > 1`` ``cu_seqlens_padded``); no ``attention_mask``."""
    from loongforge.llm.api import pack_sequences, padded_length

    row = pack_sequences(samples, pad_multiple=pad_multiple)
    row["position_ids"] = _positions(samples, [padded_length(len(s["tokens"]), pad_multiple) for s in samples])
    row["attention_mask"] = None
    return {**row, **_media(samples)}
