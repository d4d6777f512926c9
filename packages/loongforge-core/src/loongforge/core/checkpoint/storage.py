"""Crash-safe checkpoint directories.

A checkpoint is written into ``ROOT/.tmp-<name>``, every file fsynced, then renamed to
``ROOT/<name>``; the ``ROOT/latest`` pointer (a one-line text file) is replaced last. A save that
dies at any point leaves the previous checkpoint and pointer untouched. Re-saving an existing
name moves the old directory to ``ROOT/.old-<name>`` for the instant between the two renames;
a save that dies there leaves the old one readable under that name (``latest_checkpoint``
finds it). The next save into ``ROOT`` removes leftover temp dirs and settles ``.old-`` ones.

``latest`` never moves to a lower step: a save of step N into a root whose ``latest`` is past N is
refused before anything is written (``CheckpointOrderError``), and again at the commit.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from loongforge.core.errors import UserError

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
LEFTOVER = re.compile(r"^\.(tmp|old)-(step_\d{8,})$")  # what a save that died leaves behind


class CheckpointOrderError(UserError):
    """A save that would move ``latest`` to a lower step (the root holds a later run's checkpoints)."""


RUN_CHECKPOINTS = "checkpoints"  # a run directory's checkpoint root (the default checkpoint.dir)


def checkpoint_root(source: str | Path) -> Path:
    """What a command given a run directory or a checkpoint reads: a run directory's
    ``checkpoints``, else ``source`` itself (a checkpoint root or step directory)."""
    source = Path(source)
    return source / RUN_CHECKPOINTS if (source / RUN_CHECKPOINTS).is_dir() else source


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def check_order(root: Path, name: str) -> None:
    """Refuse to publish ``name`` under ``root`` when ``latest`` names a later step."""
    pointer = root / LATEST
    if not pointer.is_file():
        return
    latest_step, step = _step_of(pointer.read_text().strip()), _step_of(name)
    if latest_step is not None and step is not None and step < latest_step:
        raise CheckpointOrderError(
            f"{root / name} not saved: {root / LATEST} is at step {latest_step}, and latest never moves back to an "
            f"earlier step ({root} holds the checkpoints of a run that got further; write to another directory)")


def _step_of(name: str) -> int | None:
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def holds_checkpoints(root: Path) -> bool:
    """Whether ``root`` is a checkpoint root: it has a ``latest`` pointer or a step directory."""
    root = Path(root)
    if not root.is_dir():
        return False
    return (root / LATEST).is_file() or any(STEP_DIR.match(p.name) and p.is_dir() for p in root.iterdir())


def enclosing_root(path: Path) -> Path | None:
    """The checkpoint root ``path`` is (or lies inside), if any (``path`` need not exist)."""
    for candidate in (path, *path.parents):
        if holds_checkpoints(candidate):
            return candidate
    return None


def remove_checkpoints(root: Path) -> list[Path]:
    """Delete everything of the format under ``root`` (step directories, ``latest``, what saves that
    died left behind); other files stay. Returns the step directories removed."""
    if not root.is_dir():
        return []
    steps = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir())
    pointer = root / LATEST
    if pointer.is_file():  # first, so a crash half-way leaves no pointer at a removed step
        pointer.unlink()
        fsync_path(root)
    for path in sorted(root.iterdir()):
        if path.name == f".{LATEST}.tmp":
            path.unlink()
        elif (STEP_DIR.match(path.name) or LEFTOVER.match(path.name)) and path.is_dir():
            shutil.rmtree(path)
    return steps


def temp_dir(root: Path, name: str) -> Path:
    return root / f".tmp-{name}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(path)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def old_dir(root: Path, name: str) -> Path:
    return root / f".old-{name}"


def recover(root: Path) -> None:
    """Clean up after saves that died: remove their temp dirs; a ``.old-<name>`` whose
    ``<name>`` is missing (died between the two renames of a re-save) is moved back, one whose
    ``<name>`` exists (died before removing it) is removed. One writer per root at a time."""
    for path in sorted(root.iterdir()):
        m = LEFTOVER.match(path.name)
        if m is None or not path.is_dir():
            continue
        if m.group(1) == "tmp":
            shutil.rmtree(path)
        else:
            final = root / m.group(2)
            if final.exists():
                shutil.rmtree(path)
            else:
                os.replace(path, final)
                fsync_path(root)


def prepare_temp(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    check_order(root, name)
    tmp = temp_dir(root, name)
    tmp.mkdir()
    return tmp


def discard_temp(root: Path, name: str) -> None:
    """Remove a failed save's ``.tmp-<name>`` (nothing else is touched)."""
    shutil.rmtree(temp_dir(root, name), ignore_errors=True)


def commit(root: Path, name: str) -> Path:
    """Atomically publish ``.tmp-<name>`` as ``<name>`` and point ``latest`` at it."""
    tmp, final = temp_dir(root, name), root / name
    check_order(root, name)
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = old_dir(root, name)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(root)
    write_latest(root, name)
    if old is not None:
        shutil.rmtree(old)
    return final


def write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory ``ROOT/latest`` points at, or None when there is no checkpoint yet."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    target = root / pointer.read_text().strip()
    if target.is_dir():
        return target
    if old_dir(root, target.name).is_dir():  # a re-save of that name died half-way
        return old_dir(root, target.name)
    from loongforge.core.checkpoint.pieces import CheckpointNotFound

    raise CheckpointNotFound(f"{pointer} points at {target.name}, which does not exist")


def prune(root: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` step directories (never the one ``latest`` names)."""
    if not keep_last:
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())
    current = latest_checkpoint(root)
    doomed = [p for _, p in steps[:-keep_last] if p != current]
    for p in doomed:
        shutil.rmtree(p)
    return doomed
