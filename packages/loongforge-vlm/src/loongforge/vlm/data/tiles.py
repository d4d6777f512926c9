"""Dynamic tiling of an image (InternVL's): the image is resized to a grid of ``columns x rows``
square tiles of ``tile`` pixels, the grid chosen among those of ``min_tiles..max_tiles`` tiles
whose aspect ratio is closest to the image's, then cut row-major into its tiles; with more than
one tile, a thumbnail (the whole image resized to one tile) follows them. This is what
transformers' InternVL image processor does with ``crop_to_patches``.

Grid choice: candidates are ordered by tile count (columns-major enumeration kept among equal
counts); a closer aspect ratio wins, and on an equal one the later candidate wins while the
image's area exceeds half of that candidate's tiled area."""

from __future__ import annotations

import numpy as np


def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """``(columns, rows)`` of the tiling of a ``height x width`` image."""
    candidates = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                  if min_tiles <= c * r <= max_tiles]
    candidates.sort(key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in candidates:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


def tile_count(height: int, width: int, tile: int, min_tiles: int, max_tiles: int, thumbnail: bool) -> int:
    """Tiles of the image, the thumbnail included."""
    columns, rows = tile_grid(height, width, tile, min_tiles, max_tiles)
    n = columns * rows
    return n + 1 if thumbnail and n > 1 else n


def tile_image(image, tile: int, min_tiles: int, max_tiles: int, thumbnail: bool) -> np.ndarray:
    """A PIL RGB image -> its tiles ``[n, tile, tile, 3]`` (uint8; resized bicubically)."""
    from PIL import Image

    width, height = image.size
    columns, rows = tile_grid(height, width, tile, min_tiles, max_tiles)
    canvas = np.asarray(image.resize((columns * tile, rows * tile), Image.BICUBIC))
    tiles = [canvas[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(columns)]
    if thumbnail and len(tiles) > 1:
        tiles.append(np.asarray(image.resize((tile, tile), Image.BICUBIC)))
    return np.stack(tiles)
