"""The tokenizer of a VLM: a ``transformers`` tokenizer with the vision special tokens of a
placeholder layout (``data.media.placeholders``).

``qwen`` (Qwen2-VL's): an image becomes ``<|vision_start|>`` + one ``<|image_pad|>`` per vision
token + ``<|vision_end|>`` (``<|video_pad|>`` for a video). ``internvl``: ``<img>`` + one
``<IMG_CONTEXT>`` per vision token + ``</img>``; a video is one such run per frame, each after
``FrameN: `` and the runs joined by newlines (as transformers' ``InternVLProcessor`` writes it). A tokenizer that lacks these
tokens (the bundled text tokenizer of loongforge-llm, the default) gets them appended, so their
ids follow its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loongforge.llm.api import DataError

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


@dataclass(frozen=True)
class PlaceholderLayout:
    """The special tokens that stand for an image or a video."""

    start: str
    end: str
    image: str
    video: str
    numbered_frames: bool = False  # a video as one ``FrameN: `` run per frame (the encoder embeds single frames)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.start, self.end, self.image, self.video)))


PLACEHOLDERS = {"qwen": PlaceholderLayout(VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD),
                "internvl": PlaceholderLayout("<img>", "</img>", "<IMG_CONTEXT>", "<IMG_CONTEXT>", numbered_frames=True)}


def default_tokenizer_dir() -> Path:
    from loongforge.llm.api import bundled_tokenizer_path

    return Path(bundled_tokenizer_path())


@dataclass(frozen=True)
class VisionTokenIds:
    image: int
    video: int
    start: int
    end: int


def load_vlm_tokenizer(path: str | Path | None = None, placeholders: str = "qwen"):
    """``(tokenizer, VisionTokenIds)`` of a local tokenizer directory (default: the bundled one)
    with the tokens of the ``placeholders`` layout."""
    from loongforge.llm.api import load_chat_tokenizer

    layout = PLACEHOLDERS[placeholders]
    tokenizer = load_chat_tokenizer(Path(path) if path is not None else default_tokenizer_dir())
    vocab = tokenizer.get_vocab()
    missing = [t for t in layout.tokens if t not in vocab]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    ids = VisionTokenIds(*(tokenizer.convert_tokens_to_ids(t) for t in (layout.image, layout.video, layout.start,
                                                                          layout.end)))
    by_token = {t: tokenizer.convert_tokens_to_ids(t) for t in layout.tokens}
    if len(set(by_token.values())) != len(by_token) or None in by_token.values():
        raise DataError(f"tokenizer {path or default_tokenizer_dir()}: {layout.tokens} do not have distinct ids ({ids})")
    return tokenizer, ids


def vision_text(kind: str, tokens: int, frame_seconds: list[float] | None = None, placeholders: str = "qwen",
                frames: int = 1) -> str:
    """The text that stands for one image/video of ``tokens`` vision tokens. With
    ``frame_seconds`` (a video's time of each temporal patch group, Qwen3-VL's layout) every group
    is its own run after its timestamp: ``<1.5 seconds><|vision_start|>...<|vision_end|>``. A
    video of ``frames`` temporal patch groups in a ``numbered_frames`` layout (InternVL, whose
    encoder embeds single frames): ``Frame1: <img>...</img>\nFrame2: <img>...</img>``."""
    layout = PLACEHOLDERS[placeholders]
    pad = layout.image if kind == "image" else layout.video
    if kind == "video" and layout.numbered_frames:
        per_frame = tokens // frames
        return "\n".join(f"Frame{i + 1}: " + layout.start + pad * per_frame + layout.end for i in range(frames))
    if kind == "image" or frame_seconds is None:
        return layout.start + pad * tokens + layout.end
    per_frame = tokens // len(frame_seconds)
    return "".join(f"<{t:.1f} seconds>" + layout.start + pad * per_frame + layout.end for t in frame_seconds)
