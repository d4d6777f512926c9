"""The shipped demo set: coloured shapes with captions and Q&A, plus short videos of a moving shape.

Generated deterministically on first use into ``CACHE_DIR/shapes-v1/`` (PNG images, MPEG-4
videos written with PyAV, and ``train.jsonl`` in the LLaVA/ShareGPT layout), so the package
ships code instead of binaries and ``lf-vlm train`` needs no download. The answers depend only
on what is drawn (colour, shape, count, direction of motion), so a model that learns to look
at the pixels drives the loss well below what the text alone allows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from loongforge.core.cache import write_atomically

VERSION = "shapes-v1"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40),
           "purple": (140, 60, 180), "orange": (240, 140, 30)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("one", "two", "three")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
IMAGES, VIDEOS = 384, 64
VIDEO_SIZE, VIDEO_FRAMES, VIDEO_FPS = 64, 8, 4


def _draw(draw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _image(rng: random.Random, path: Path) -> dict:
    from PIL import Image, ImageDraw

    w, h = rng.choice((48, 64, 80, 96)), rng.choice((48, 64, 80))
    background = tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(img)
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    count = rng.choice((1, 1, 2, 3))
    size = max(12, min(w, h) // (2 if count == 1 else 3))
    for k in range(count):
        x = int((k + 0.5) * w / count - size / 2 + rng.randint(-2, 2))
        y = rng.randint(2, max(2, h - size - 2))
        _draw(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
    img.save(path)
    return {"colour": colour, "shape": shape, "count": count}


def _video(rng: random.Random, path: Path) -> dict:
    import av
    from PIL import Image, ImageDraw

    colour, shape, direction = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    size, span = 16, VIDEO_SIZE - 16 - 8
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width = stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        for f in range(VIDEO_FRAMES):
            step = 4 + span * f // (VIDEO_FRAMES - 1)
            x = step if dx > 0 else (VIDEO_SIZE - size - step if dx < 0 else (VIDEO_SIZE - size) // 2)
            y = step if dy > 0 else (VIDEO_SIZE - size - step if dy < 0 else (VIDEO_SIZE - size) // 2)
            img = Image.new("RGB", (VIDEO_SIZE, VIDEO_SIZE), (245, 245, 245))
            _draw(ImageDraw.Draw(img), shape, (x, y, x + size, y + size), COLOURS[colour])
            frame = av.VideoFrame.from_ndarray(np.asarray(img), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"colour": colour, "shape": shape, "direction": direction}


def _turns(rng: random.Random, facts: dict) -> list[tuple[str, str]]:
    colour, shape, count = facts["colour"], facts["shape"], facts["count"]
    plural = shape + ("s" if count > 1 else "")
    pool = [
        ("Describe the image.", f"{NUMBERS[count - 1].capitalize()} {colour} {plural}."),
        (f"What colour {'is the' if count == 1 else 'are the'} {plural}?", f"{colour.capitalize()}."),
        ("What shape is in the picture?", f"A {shape}."),
        ("How many shapes are there?", f"{NUMBERS[count - 1].capitalize()}."),
    ]
    return rng.sample(pool, rng.choice((1, 1, 2)))


def _conversation(turns: list[tuple[str, str]], tag: str) -> list[dict]:
    out = []
    for i, (question, answer) in enumerate(turns):
        out.append({"from": "human", "value": (tag + "\n" if i == 0 else "") + question})
        out.append({"from": "gpt", "value": answer})
    return out


def _generate(directory: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True)
    (directory / "videos").mkdir()
    records = []
    for i in range(IMAGES):
        name = f"images/{i:04d}.png"
        facts = _image(rng, directory / name)
        records.append({"id": f"image-{i}", "image": name, "conversations": _conversation(_turns(rng, facts), "<image>")})
    for i in range(VIDEOS):
        name = f"videos/{i:03d}.mp4"
        facts = _video(rng, directory / name)
        q = f"Which way does the {facts['colour']} {facts['shape']} move?"
        records.append({"id": f"video-{i}", "video": name,
                        "conversations": _conversation([(q, f"{facts['direction'].capitalize()}.")], "<video>")})
    rng.shuffle(records)
    with open(directory / "train.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def shipped_dataset(cache_dir: str | Path) -> Path:
    """The demo set's ``train.jsonl``, generated into ``cache_dir`` unless already there.
    Concurrent callers are safe (written to a temporary directory, then renamed)."""
    directory = Path(cache_dir) / VERSION
    if not (directory / "train.jsonl").is_file():
        write_atomically(directory, _generate)
    return directory / "train.jsonl"
