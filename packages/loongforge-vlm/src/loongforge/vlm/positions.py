"""Multimodal RoPE positions of one sample (Qwen2-VL's 3D positions, as transformers computes them).

Text tokens get ``(p, p, p)`` with ``p`` counting up by one. The ``t*h*w`` tokens of an image or
a video (``h, w`` in LLM tokens, i.e. patches / merge) starting at position ``s`` get
``(s + floor(frame * interval), s + row, s + column)``, where ``interval`` is 1 for an image and
``tokens_per_second * seconds_per_frame_group`` for a video; the text after it continues at
``s + max(h, w)``.

With ``frames_as_images`` (Qwen3-VL) every temporal patch group of a video is positioned as an
image of its own: the ``t`` frames of a video are ``t`` items of grid ``(1, h, w)``, in order
(each run of ``h*w/merge²`` tokens, adjacent or separated by timestamp text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionItem:
    """One image or video of a sample, in LLM-token units after merging."""

    grid: tuple[int, int, int]  # (t, h, w) in patches
    video: bool = False
    seconds_per_grid_t: float = 1.0  # seconds one temporal patch spans (videos)


def frames_of(items: Sequence[VisionItem]) -> list[VisionItem]:
    """``items`` with every video split into its frames (items of grid ``(1, h, w)``)."""
    out = []
    for item in items:
        t, h, w = item.grid
        out += [VisionItem((1, h, w), True, item.seconds_per_grid_t)] * t if item.video else [item]
    return out


def mrope_positions(tokens: np.ndarray, items: Sequence[VisionItem], vision_token_ids: Sequence[int], merge: int,
                    tokens_per_second: float, frames_as_images: bool = False) -> np.ndarray:
    """``[3, len(tokens)]`` positions; ``items`` are the sample's images/videos in token order,
    each a run of ``t*h*w/merge²`` consecutive vision tokens (``frames_as_images``: see above)."""
    if frames_as_images:
        items = frames_of(items)
    is_vision = np.isin(tokens, np.asarray(list(vision_token_ids)))
    out = np.empty((3, len(tokens)), dtype=np.int64)
    pos, i = 0, 0
    runs = iter(items)
    n = len(tokens)
    while i < n:
        if not is_vision[i]:
            j = i
            while j < n and not is_vision[j]:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        item = next(runs, None)
        if item is None:
            raise ValueError(f"vision token at position {i} has no image/video left to describe it")
        t, h, w = item.grid
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if i + count > n or not is_vision[i:i + count].all():
            raise ValueError(f"the image/video of grid {item.grid} needs {count} consecutive vision tokens at position {i}")
        interval = tokens_per_second * item.seconds_per_grid_t if item.video else 1.0
        frames = (np.arange(t) * interval).astype(np.int64)
        out[0, i:i + count] = np.repeat(frames, gh * gw) + pos
        out[1, i:i + count] = np.tile(np.repeat(np.arange(gh), gw), t) + pos
        out[2, i:i + count] = np.tile(np.arange(gw), t * gh) + pos
        pos += max(gh, gw)
        i += count
    if next(runs, None) is not None:
        raise ValueError("more images/videos than runs of vision tokens in the sample")
    return out
