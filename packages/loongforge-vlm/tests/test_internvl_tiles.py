"""InternVL's data layout against transformers: dynamic tiling against its image processor
(``GotOcr2ImageProcessorPil`` with ``crop_to_patches``, what InternVL's processor uses): our
patches of a non-square image, put back into tiles, are its ``pixel_values``; the grid
choice agrees with transformers' for many shapes; a video's placeholder text is its processor's."""

import numpy as np
import pytest
import torch

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def processor(tile, max_tiles):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1,
                                    max_patches=max_tiles, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)


@pytest.mark.parametrize("size", [(100, 37), (37, 100), (64, 64), (90, 30)])
def test_tiles_equal_transformers_pixel_values(tmp_path, size):
    from PIL import Image

    from loongforge.vlm.data.media import MediaConfig, PatchGeometry, image_grid, load_image

    rgb = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path = tmp_path / "image.png"
    Image.fromarray(rgb).save(path)
    tile, p = 32, 8
    cfg = MediaConfig(tile_size=tile, max_tiles=6, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    geo = PatchGeometry(p, 1, 2)
    patches, grid = load_image(path, cfg, geo)
    expected = processor(tile, 6)(Image.open(path).convert("RGB"), return_tensors="pt")["pixel_values"]
    assert grid == image_grid(path, cfg, geo) == (expected.shape[0], tile // p, tile // p)
    # block-major patches [n * 16, 3*8*8] back to tiles [n, 3, 32, 32]
    n, side, m = grid[0], tile // p, 2
    x = patches.reshape(n, side // m, side // m, m, m, 3, p, p).transpose(0, 5, 1, 3, 6, 2, 4, 7)
    torch.testing.assert_close(torch.from_numpy(np.ascontiguousarray(x.reshape(n, 3, tile, tile))), expected,
                               atol=1e-5, rtol=0)


def test_tile_grid_matches_transformers():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    from loongforge.vlm.data.tiles import tile_grid

    for h in range(10, 400, 37):
        for w in range(10, 400, 29):
            for lo, hi in ((1, 12), (1, 6), (2, 9)):
                assert tile_grid(h, w, 448, lo, hi) == get_optimal_tiled_canvas((h, w), (448, 448), lo, hi), (h, w, lo, hi)


@pytest.mark.parametrize("frames", [1, 3])
def test_video_text_is_transformers_frame_runs(frames):
    """A video in the InternVL layout is what transformers' ``InternVLProcessor.replace_video_token``
    writes for it: ``FrameN: <img><IMG_CONTEXT>...</img>`` per frame, joined by newlines (an image
    stays one run: ``replace_image_token``)."""
    from types import SimpleNamespace

    from transformers.models.internvl.processing_internvl import InternVLProcessor

    from loongforge.vlm.data.tokenizer import vision_text

    per_frame = 4
    tokens = SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                             image_seq_length=per_frame)
    video = {"pixel_values_videos": [torch.zeros(frames, 3, 32, 32)]}
    expected = InternVLProcessor.replace_video_token(tokens, video, 0)
    assert vision_text("video", frames * per_frame, placeholders="internvl", frames=frames) == expected
    image = InternVLProcessor.replace_image_token(tokens, {"num_patches": [frames]}, 0)
    assert vision_text("image", frames * per_frame, placeholders="internvl") == image
