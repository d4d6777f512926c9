"""Reading videos (PyAV) and images (Pillow) into ``[3, F, H, W]`` tensors in [-1, 1], at a size the
VAE and the DiT patching accept, and writing clips for the synthetic set."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loongforge.core.errors import DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def read_frames(path: str | Path, max_frames: int, frame_stride: int = 1) -> np.ndarray:
    """Up to ``max_frames`` RGB frames ``[F, H, W, 3]`` uint8, every ``frame_stride``-th one."""
    path = Path(path)
    if path.suffix.lower() in IMAGE_SUFFIXES:
        import struct

        from PIL import Image

        try:
            with Image.open(path) as img:
                return np.array(img.convert("RGB"))[None]
        except (OSError, ValueError, SyntaxError, EOFError, struct.error) as exc:  # what PIL's decoders raise
            raise DataError(f"{path}: cannot decode the image, not an image or truncated ({type(exc).__name__}: "
                            f"{exc})") from exc
    import av

    frames = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            for i, frame in enumerate(container.decode(stream)):
                if i % frame_stride == 0:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if len(frames) >= max_frames:
                        break
    except (av.error.FFmpegError, IndexError) as exc:
        raise DataError(f"{path}: cannot decode video ({exc})") from exc
    if not frames:
        raise DataError(f"{path}: no video frames")
    return np.stack(frames)


def usable_frames(n: int, temporal_factor: int) -> int:
    """The largest ``1 + k * temporal_factor <= n`` (what the causal Wan VAE encodes)."""
    return 1 + ((n - 1) // temporal_factor) * temporal_factor


def target_size(height: int, width: int, max_area: int, multiple: int) -> tuple[int, int]:
    """Resize target keeping the aspect ratio: area <= ``max_area``, sides multiples of ``multiple``."""
    scale = min(1.0, math.sqrt(max_area / (height * width)))
    h = max(multiple, int(height * scale) // multiple * multiple)
    w = max(multiple, int(width * scale) // multiple * multiple)
    return h, w


def to_model_input(frames: np.ndarray, max_area: int, multiple: int, temporal_factor: int) -> torch.Tensor:
    """``[F, H, W, 3]`` uint8 -> ``[3, F', H', W']`` float in [-1, 1]: frames cut to ``1 + k*t``,
    resized (antialiased) to cover the target then center-cropped to it."""
    frames = frames[: usable_frames(frames.shape[0], temporal_factor)]
    height, width = frames.shape[1:3]
    return fit_frames(frames, *target_size(height, width, max_area, multiple))


def fit_frames(frames: np.ndarray, h: int, w: int) -> torch.Tensor:
    """``[F, H, W, 3]`` uint8 -> ``[3, F, h, w]`` float in [-1, 1], resized (antialiased) to cover
    ``h x w`` then center-cropped to it."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [F, 3, H, W]
    h0, w0 = x.shape[-2:]
    scale = max(h / h0, w / w0)
    rh, rw = max(h, round(h0 * scale)), max(w, round(w0 * scale))
    if (rh, rw) != (h0, w0):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
    top, left = (rh - h) // 2, (rw - w) // 2
    x = x[..., top : top + h, left : left + w]
    return x.clamp(-1, 1).permute(1, 0, 2, 3).contiguous()


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8) -> None:
    """Write ``[F, H, W, 3]`` uint8 frames as H.264 MP4 (single-threaded, so reproducible)."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "12", "threads": "1"})
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
