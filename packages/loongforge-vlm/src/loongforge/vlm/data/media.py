"""Images and videos -> patch sequences the encoders read.

An image is resized so that both sides are multiples of ``patch_size * spatial_merge_size``
and its area is within ``[min_pixels, max_pixels]`` (aspect ratio kept as well as rounding
allows), normalised, repeated to ``temporal_patch_size`` frames and cut into patches laid out
block-major (see ``loongforge.vlm.encoders.geometry``). With ``tile_size`` (InternVL) an image is
instead cut into square tiles plus a thumbnail (``loongforge.vlm.data.tiles``), each tile one
frame of the item's grid. A video is decoded with PyAV, sampled to
``fps`` frames per second (at most ``max_frames``, a multiple of ``temporal_patch_size``) and
patchified the same way, every ``temporal_patch_size`` frames forming one temporal patch.

Sizes are computed from file headers alone (``image_size``, ``probe_video``), so the dataset
index knows every sample's token count without decoding any pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loongforge.llm.api import DataError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class MediaConfig:
    """Pixel budgets and sampling of images and videos (the ``data.media`` group)."""

    min_pixels: int = 64 * 64  # an image is resized to at least this many pixels
    max_pixels: int = 128 * 128  # an image is resized to at most this many pixels
    video_min_pixels: int = 32 * 32  # a video frame is resized to at least this many pixels
    video_max_pixels: int = 64 * 64  # a video frame is resized to at most this many pixels
    video_fps: float = 2.0  # frames per second sampled from a video
    video_max_frames: int = 8  # the most frames taken from one video
    tile_size: int = 0  # > 0: images become tiles of this side (InternVL's dynamic tiling); 0: one resized frame
    min_tiles: int = 1  # the fewest tiles of an image (with tile_size)
    max_tiles: int = 12  # the most tiles of an image, the thumbnail not counted
    tile_thumbnail: bool = True  # a whole-image tile after the tiles of a multi-tile image
    placeholders: str = "qwen"  # media tokens: qwen (<|vision_start|><|image_pad|>...) | internvl (<img><IMG_CONTEXT>...)
    # per-channel pixel mean subtracted (CLIP's by default)
    mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    # per-channel pixel std divided by (CLIP's by default)
    std: list[float] = field(default_factory=lambda: list(CLIP_STD))

    def __post_init__(self):
        for key in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "video_max_frames"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.media.{key}={getattr(self, key)}: must be >= 1")
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise ValueError("data.media: min_pixels must not exceed max_pixels (images and videos)")
        if self.tile_size < 0 or not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"data.media: tile_size={self.tile_size}, min_tiles={self.min_tiles}, max_tiles="
                             f"{self.max_tiles}: tile_size >= 0 and 1 <= min_tiles <= max_tiles")
        if self.placeholders not in ("qwen", "internvl"):
            raise ValueError(f"data.media.placeholders={self.placeholders!r}: one of qwen, internvl")
        if self.video_fps <= 0:
            raise ValueError(f"data.media.video_fps={self.video_fps}: must be > 0")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError("data.media.mean/std: three values each, std > 0")


@dataclass(frozen=True)
class PatchGeometry:
    """What the encoder expects of a patch sequence."""

    patch_size: int
    temporal_patch_size: int
    merge: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(h, w)``: multiples of ``factor`` near ``(height, width)`` with area in the budget."""
    if height < 1 or width < 1:
        raise DataError(f"image of size {width}x{height} is empty")
    if max(height, width) / min(height, width) > 200:
        raise DataError(f"image of size {width}x{height}: aspect ratio above 200 is not supported")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    if h < factor or w < factor:
        raise DataError(f"image of size {width}x{height} fits no {factor}-pixel patch grid within "
                        f"[{min_pixels}, {max_pixels}] pixels (raise min_pixels)")
    return h, w


def patchify(frames: np.ndarray, geo: PatchGeometry) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``frames [T, C, H, W]`` (T a multiple of the temporal patch) -> ``(patches [N, C*tp*p*p], (t, h, w))``."""
    T, C, H, W = frames.shape
    p, tp, m = geo.patch_size, geo.temporal_patch_size, geo.merge
    if T % tp or H % (p * m) or W % (p * m):
        raise ValueError(f"frames of shape {frames.shape} do not tile into patches of {tp}x{p}x{p} merged {m}x{m}")
    gt, gh, gw = T // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block row, block col, row in block, col in block, C, tp, p, p
    return np.ascontiguousarray(x.reshape(gt * gh * gw, C * tp * p * p)), (gt, gh, gw)


def _normalise(rgb: np.ndarray, cfg: MediaConfig) -> np.ndarray:
    """``[..., H, W, 3]`` uint8 -> ``[..., 3, H, W]`` float32, standardised."""
    x = rgb.astype(np.float32) / 255.0
    x = (x - np.asarray(cfg.mean, dtype=np.float32)) / np.asarray(cfg.std, dtype=np.float32)
    return np.moveaxis(x, -1, -3)


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` from the file header."""
    import struct

    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as err:  # what PIL's header parsers raise
        raise DataError(f"{path}: cannot read the image ({type(err).__name__}: {err})") from err


def check_tiles(cfg: MediaConfig, geo: PatchGeometry) -> None:
    """Tiles fit the encoder: single-frame patches, a side of whole merged patches."""
    if geo.temporal_patch_size != 1 or cfg.tile_size % geo.factor:
        raise ValueError(f"data.media.tile_size={cfg.tile_size}: needs an encoder of temporal_patch_size 1 (it has "
                         f"{geo.temporal_patch_size}) and a multiple of patch_size x spatial_merge_size ({geo.factor})")


def image_grid(path: Path, cfg: MediaConfig, geo: PatchGeometry) -> tuple[int, int, int]:
    width, height = image_size(path)
    if cfg.tile_size:
        from loongforge.vlm.data.tiles import tile_count

        check_tiles(cfg, geo)
        side = cfg.tile_size // geo.patch_size
        return tile_count(height, width, cfg.tile_size, cfg.min_tiles, cfg.max_tiles, cfg.tile_thumbnail), side, side
    h, w = fit_size(height, width, geo.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, h // geo.patch_size, w // geo.patch_size


def decoded_rgb(path: Path):
    """The image at ``path`` decoded whole as a PIL RGB image; a file whose header reads but whose
    pixels do not (truncated, corrupt) is a ``DataError`` naming it."""
    import struct

    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as err:  # what PIL's decoders raise
        raise DataError(f"{path}: cannot decode the image, truncated or corrupt ({type(err).__name__}: {err})") from err


def load_image(path: Path, cfg: MediaConfig, geo: PatchGeometry) -> tuple[np.ndarray, tuple[int, int, int]]:
    from PIL import Image

    _, gh, gw = image_grid(path, cfg, geo)
    if cfg.tile_size:
        from loongforge.vlm.data.tiles import tile_image

        tiles = tile_image(decoded_rgb(path), cfg.tile_size, cfg.min_tiles, cfg.max_tiles, cfg.tile_thumbnail)
        return patchify(_normalise(tiles, cfg), geo)
    rgb = np.asarray(decoded_rgb(path).resize((gw * geo.patch_size, gh * geo.patch_size), Image.BICUBIC))
    frame = _normalise(rgb, cfg)[None]
    return patchify(np.repeat(frame, geo.temporal_patch_size, axis=0), geo)


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    fps: float
    width: int
    height: int


def probe_video(path: Path) -> VideoInfo:
    """Frame count, rate and size of the first video stream, from the container."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = stream.frames
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            if not frames:  # not in the header: count them
                frames = sum(1 for _ in container.demux(stream) if _.size)
            return VideoInfo(int(frames), fps, stream.codec_context.width, stream.codec_context.height)
    except (av.error.FFmpegError, IndexError) as err:
        raise DataError(f"{path}: cannot read a video stream ({err})") from err


@dataclass(frozen=True)
class VideoSampling:
    """Which frames are read and the grid they make."""

    indices: tuple[int, ...]
    grid: tuple[int, int, int]
    seconds_per_grid_t: float


def video_sampling(info: VideoInfo, cfg: MediaConfig, geo: PatchGeometry, where: str) -> VideoSampling:
    tp = geo.temporal_patch_size
    if info.frames < 1 or info.fps <= 0:
        raise DataError(f"{where}: video has {info.frames} frames at {info.fps} fps")
    duration = info.frames / info.fps
    wanted = min(round(duration * cfg.video_fps), cfg.video_max_frames, info.frames)
    n = max(tp, wanted // tp * tp)
    indices = tuple(int(i) for i in np.round(np.linspace(0, info.frames - 1, n)))
    h, w = fit_size(info.height, info.width, geo.factor, cfg.video_min_pixels, cfg.video_max_pixels)
    sampled_fps = n / duration
    return VideoSampling(indices, (n // tp, h // geo.patch_size, w // geo.patch_size), tp / sampled_fps)


def load_video(path: Path, sampling: VideoSampling, cfg: MediaConfig, geo: PatchGeometry) -> tuple[np.ndarray, tuple[int, int, int]]:
    import av

    wanted = set(sampling.indices)
    h, w = sampling.grid[1] * geo.patch_size, sampling.grid[2] * geo.patch_size
    frames = {}
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                frames[i] = frame.to_ndarray(width=w, height=h, format="rgb24")
            if i >= sampling.indices[-1]:
                break
    missing = sorted(wanted - set(frames))
    if missing:
        raise DataError(f"{path}: frames {missing[:5]} could not be decoded")
    rgb = np.stack([frames[i] for i in sampling.indices])
    return patchify(_normalise(rgb, cfg), geo)
