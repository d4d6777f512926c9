"""The tokenizer of a VLM: a ``transformers`` tokenizer with Qwen2-VL's vision special tokens.

An image becomes ``<|vision_start|>`` + one ``<|image_pad|>`` per vision token +
``<|vision_end|>`` (``<|video_pad|>`` for a video). A tokenizer that lacks these tokens (the
bundled text tokenizer of loongforge-llm, the default) gets them appended, so their ids follow
its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loongforge.llm.api import DataError

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def default_tokenizer_dir() -> Path:
    from loongforge.llm.api import bundled_tokenizer_path

    return Path(bundled_tokenizer_path())


@dataclass(frozen=True)
class VisionTokenIds:
    image: int
    video: int
    start: int
    end: int


def load_vlm_tokenizer(path: str | Path | None = None):
    """``(tokenizer, VisionTokenIds)`` of a local tokenizer directory (default: the bundled one)."""
    from loongforge.llm.api import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(Path(path) if path is not None else default_tokenizer_dir())
    vocab = tokenizer.get_vocab()
    missing = [t for t in VISION_TOKENS if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    ids = VisionTokenIds(*(tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)))
    if len({ids.image, ids.video, ids.start, ids.end}) != 4 or None in (ids.image, ids.video, ids.start, ids.end):
        raise DataError(f"tokenizer {path or default_tokenizer_dir()}: {VISION_TOKENS} do not have distinct ids ({ids})")
    return tokenizer, ids


def vision_text(kind: str, tokens: int, frame_seconds: list[float] | None = None) -> str:
    """The text that stands for one image/video of ``tokens`` vision tokens. With
    ``frame_seconds`` (a video's time of each temporal patch group, Qwen3-VL's layout) every group
    is its own run after its timestamp: ``<1.5 seconds><|vision_start|>...<|vision_end|>``."""
    pad = IMAGE_PAD if kind == "image" else VIDEO_PAD
    if kind == "image" or frame_seconds is None:
        return VISION_START + pad * tokens + VISION_END
    per_frame = tokens // len(frame_seconds)
    return "".join(f"<{t:.1f} seconds>" + VISION_START + pad * per_frame + VISION_END for t in frame_seconds)
