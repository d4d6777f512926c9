"""One micro-batch: several samples packed end to end into one row.

Each sample attends only to itself: with more than one sample the row carries a boolean
``attention_mask [1, 1, T, T]`` (True: masked) that is causal within each sample and blocks
attention across samples; megatron's local attention reads it directly. Positions restart for
every sample (multimodal RoPE positions are per sample; with 1D RoPE the foundation's
positions run on, which changes nothing within a sample since RoPE scores depend on position
differences only). The samples' media are concatenated in order, so the placeholder tokens of
the row and the vision tokens of ``pixel_values`` line up.
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


def pack(samples: Sequence[dict]) -> dict:
    """The packed micro-batch of ``samples`` (items of ``VLMDataset``)."""
    lengths = [len(s["tokens"]) for s in samples]
    row = {k: torch.from_numpy(np.concatenate([s[k] for s in samples])).unsqueeze(0)
           for k in ("tokens", "labels", "loss_mask")}
    positions = [np.asarray(s["position_ids"]) for s in samples]
    if positions[0].ndim == 2:  # mrope: [3, L] each -> [3, 1, T]
        row["position_ids"] = torch.from_numpy(np.concatenate(positions, axis=1)).unsqueeze(1)
    else:
        row["position_ids"] = torch.from_numpy(np.concatenate(positions)).unsqueeze(0)
    row["attention_mask"] = document_causal_mask(lengths) if len(samples) > 1 else None
    row["pixel_values"] = torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples]).astype(np.float32))
    row["grid_thw"] = torch.from_numpy(np.concatenate([s["grid_thw"] for s in samples]))
    return row
