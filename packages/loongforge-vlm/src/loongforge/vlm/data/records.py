"""Image/video conversation records (LLaVA / ShareGPT-4V style JSONL).

One JSON object per line::

    {"image": "images/0001.png",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is in the picture?"},
                       {"from": "gpt", "value": "A red circle."}]}

``image`` / ``video`` is a path or a list of paths (relative to the JSONL file's directory, or
``data.media_root``); OpenAI-style ``messages`` work too. Each ``<image>`` / ``<video>`` tag in
the text marks where the next image / video goes; a record with media but no tags gets them at
the start of its first user message (the LLaVA convention). Tag and media counts must match.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loongforge.llm.api import DataError, parse_chat_record

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"


@dataclass(frozen=True)
class Record:
    where: str  # file:line
    messages: list[dict[str, str]]
    media: list[tuple[str, Path]]  # ("image" | "video", path), in the order their tags appear


def _paths(record: dict, key: str, base: Path, where: str) -> list[Path]:
    value = record.get(key, [])
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise DataError(f"{where}: key '{key}' must be a path or a list of paths, got {value!r:.80}")
    return [Path(v) if Path(v).is_absolute() else base / v for v in values]


def _tag_order(messages: list[dict[str, str]]) -> list[str]:
    order = []
    for m in messages:
        text, i = m["content"], 0
        while True:
            hits = [(text.find(tag, i), kind) for tag, kind in ((IMAGE_TAG, "image"), (VIDEO_TAG, "video"))]
            hits = [(p, k) for p, k in hits if p >= 0]
            if not hits:
                break
            p, kind = min(hits)
            order.append(kind)
            i = p + 1
    return order


def parse_media_record(record, where: str, base: Path) -> Record:
    messages = parse_chat_record(record, where)
    images = _paths(record, "image", base, where) + _paths(record, "images", base, where)
    videos = _paths(record, "video", base, where) + _paths(record, "videos", base, where)
    order = _tag_order(messages)
    if not order and (images or videos):
        first = next(i for i, m in enumerate(messages) if m["role"] == "user") if any(
            m["role"] == "user" for m in messages) else 0
        tags = IMAGE_TAG * len(images) + VIDEO_TAG * len(videos)
        messages[first] = {**messages[first], "content": tags + "\n" + messages[first]["content"]}
        order = _tag_order(messages)
    counts = {"image": order.count("image"), "video": order.count("video")}
    if counts["image"] != len(images) or counts["video"] != len(videos):
        raise DataError(f"{where}: {counts['image']} {IMAGE_TAG} and {counts['video']} {VIDEO_TAG} tags for "
                        f"{len(images)} image(s) and {len(videos)} video(s)")
    pools = {"image": iter(images), "video": iter(videos)}
    media = [(kind, next(pools[kind])) for kind in order]
    for kind, path in media:
        if not path.is_file():
            raise DataError(f"{where}: {kind} file not found: {path}")
    return Record(where, messages, media)


def read_records(path: Path, media_root: Path | None = None) -> Iterator[Record]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path: file not found: {path}")
    base = Path(media_root) if media_root is not None else path.parent
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from err
            yield parse_media_record(raw, where, base)
