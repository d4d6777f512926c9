"""Where each patch of a packed patch sequence sits, from the items' grids alone.

An item (an image or a video) of grid ``(t, h, w)`` in patches contributes ``t*h*w``
consecutive patches. Within a frame, patches are laid out *block-major*: the
``m x m`` patches of one LLM token (``m = spatial_merge_size``) are consecutive, blocks in
row-major order. This is the layout the image processor writes and the projector's merge
relies on.
"""

from __future__ import annotations

import torch


def patch_counts(grid_thw: torch.Tensor) -> list[int]:
    return [int(t * h * w) for t, h, w in grid_thw.tolist()]


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Boundaries of the frames (each frame is one full-attention segment)."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def block_major_hw(h: int, w: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch of one frame, in block-major order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).permute(0, 2, 1, 3).flatten(),
            cols.reshape(shape).permute(0, 2, 1, 3).flatten())


def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch of the packed sequence."""
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        r, c = block_major_hw(h, w, merge, grid_thw.device)
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
    return torch.cat(rows), torch.cat(cols)


def window_order(grid_thw: torch.Tensor, merge: int, window_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder the LLM-token units (groups of ``merge²`` patches) so that each attention window
    is contiguous: ``(unit_order, window_lengths_in_patches)``.

    A window covers ``window_units x window_units`` units of one frame; windows tile a frame
    row-major from its top-left corner (the last row/column of windows may be partial), and a
    window's units keep their row-major order.
    """
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window_units), -(-gw // window_units)
        frame = torch.arange(t)[:, None, None]
        y = torch.arange(gh)[None, :, None]
        x = torch.arange(gw)[None, None, :]
        window = ((frame * nh + y // window_units) * nw + x // window_units).expand(t, gh, gw).flatten()
        perm = torch.sort(window, stable=True).indices
        order.append(perm + offset)
        counts = torch.bincount(window, minlength=t * nh * nw)
        lengths.append(counts[counts > 0] * merge * merge)
        offset += t * gh * gw
    return torch.cat(order).to(grid_thw.device), torch.cat(lengths).to(grid_thw.device)


def expand_units(unit_order: torch.Tensor, merge: int) -> torch.Tensor:
    """A unit permutation as a patch permutation (each unit is ``merge²`` consecutive patches)."""
    k = merge * merge
    return (unit_order[:, None] * k + torch.arange(k, device=unit_order.device)).flatten()


def axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of 2D (row, column) rotary positions: ``head_dim / 4`` of them, shared
    by the two axes."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def axial_rotary(grid_thw: torch.Tensor, merge: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[patches, head_dim]`` rotary angles of every patch: row angles then column angles, twice
    (megatron's rotate-half layout over the whole head dim)."""
    rows, cols = patch_rows_cols(grid_thw, merge)
    inv = inv_freq.to(grid_thw.device, torch.float32)
    angles = torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)
    return torch.cat([angles, angles], dim=-1)
