"""Where a command may write its output: never into a checkpoint root.

A checkpoint root (a directory with a ``latest`` pointer or ``step_*`` directories: a run's
``RUN_DIR/checkpoints``, a ``checkpoint.dir``, a converted checkpoint) belongs to the run that saves
there: ``convert``, ``lora merge`` and ``train --save-FORMAT`` refuse an output at or inside one,
before reading anything, rather than publish a step of their own over the run's ``latest`` or
leave files where the run's pruning and ``checkpoint.overwrite`` remove whole directories.
"""

from __future__ import annotations

from pathlib import Path

from loongforge.core.checkpoint import storage
from loongforge.core.errors import UserError


class OutputInCheckpointsError(UserError):
    """An output path at or inside a checkpoint root."""


def check_output_path(out: str | Path, what: str) -> Path:
    """``out`` resolved, refused (``OutputInCheckpointsError``) when it is or lies inside a
    checkpoint root; ``what`` names the argument in the message (``convert OUT``)."""
    path = Path(out).expanduser().resolve()
    root = storage.enclosing_root(path)
    if root is not None:
        pointer = root / storage.LATEST
        latest = f", latest {pointer.read_text().strip()}" if pointer.is_file() else ""
        inside = "is" if root == path else "is inside"
        raise OutputInCheckpointsError(f"{what} {out} {inside} the checkpoint root {root} (a run's "
                                       f"checkpoints{latest}); write the output outside it")
    return path
