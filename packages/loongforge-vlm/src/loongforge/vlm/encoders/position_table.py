"""A learned table of absolute patch positions over a square grid, resampled to each frame's grid
(SigLIP: bicubic; Qwen3-VL: bilinear with aligned corners) and read in the block-major patch
order of ``geometry``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge.vlm.encoders import geometry


def new_position_table(entries: int, hidden: int, std: float, dtype) -> torch.nn.Parameter:
    """A ``[entries, hidden]`` table, normal-initialised."""
    table = torch.nn.Parameter(torch.empty(entries, hidden, dtype=dtype))
    torch.nn.init.normal_(table, std=std)
    return table


def frame_positions(table: torch.Tensor, side: int, h: int, w: int, merge: int, mode: str,
                    align_corners: bool) -> torch.Tensor:
    """The ``[h*w, hidden]`` positions of one ``h x w`` frame (block-major) from a table of
    ``side x side`` positions (row-major), resampled with ``F.interpolate(mode, align_corners)``
    unless the grids are the same."""
    if (h, w) != (side, side):
        grid = table.reshape(side, side, -1).permute(2, 0, 1)[None].float()
        resampled = F.interpolate(grid, size=(h, w), mode=mode, align_corners=align_corners)[0]
        table = resampled.permute(1, 2, 0).reshape(h * w, -1).to(table.dtype)
    rows, cols = geometry.block_major_hw(h, w, merge, table.device)
    return table[rows * w + cols]


def packed_positions(table: torch.Tensor, side: int, grid_thw: torch.Tensor, merge: int, mode: str,
                     align_corners: bool) -> torch.Tensor:
    """The positions of every patch of the packed sequence (each frame of an item the same)."""
    return torch.cat([frame_positions(table, side, h, w, merge, mode, align_corners).repeat(t, 1)
                      for t, h, w in grid_thw.tolist()])
