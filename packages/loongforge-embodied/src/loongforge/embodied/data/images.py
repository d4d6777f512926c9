"""Camera frames to the policy's square input in [-1, 1] (SigLIP convention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def resize_with_pad(image: torch.Tensor, size: int) -> torch.Tensor:
    """``[C, H, W]`` in [0, 1] -> ``[C, size, size]``: aspect-preserving bilinear resize, zero padding
    centred (a no-op when the frame is already ``size`` x ``size``)."""
    c, h, w = image.shape
    if (h, w) == (size, size):
        return image
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    resized = F.interpolate(image[None].float(), size=(nh, nw), mode="bilinear", align_corners=False)[0]
    top, left = (size - nh) // 2, (size - nw) // 2
    return F.pad(resized, (left, size - nw - left, top, size - nh - top), value=0.0)


def to_model_range(image: torch.Tensor) -> torch.Tensor:
    return image.float() * 2.0 - 1.0
