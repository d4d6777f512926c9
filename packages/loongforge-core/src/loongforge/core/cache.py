"""Where every derived file goes (tokenized corpora, sample indices, generated demo datasets):
``$LOONGFORGE_CACHE`` when set, else ``$XDG_CACHE_HOME/loongforge``, else ``~/.cache/loongforge``.
A config key that names a cache directory (``data.cache_dir``) defaults to a folder in it.

A cache directory is written once per node and atomically (``build_once``, ``write_atomically``):
into a private temporary sibling that is renamed into place when complete, so a crashed build
leaves nothing that looks finished, and processes (or nodes sharing one file system) that race to
build the same directory are all safe; the first rename wins.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from loongforge.core.errors import DataError

ENV_VAR = "LOONGFORGE_CACHE"


def cache_root() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "loongforge"


def cache_dir(*parts: str) -> Path:
    """``cache_root() / parts...`` (not created here)."""
    return cache_root().joinpath(*parts)


def builds_here() -> bool:
    """Whether this process writes shared caches: every process when torch.distributed is not
    initialised, else local rank 0 of each node (so node-local cache directories work too)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def write_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` fills a fresh temporary sibling of ``directory``, which is then renamed to it.
    If another process renamed its copy first, this one's is discarded. A failing ``write`` leaves
    no directory behind."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        tmp.rename(directory)
    except OSError:
        if not directory.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_once(directory: Path, write: Callable[[Path], None], what: str, done: str = "meta.json") -> None:
    """Make the cache ``directory`` (complete when it holds ``done``) unless it is there.

    With torch.distributed initialised every rank must call this: the builders of each node write
    (``write_atomically``), then all ranks meet, so nobody reads before the cache exists, and a
    ``DataError`` on one rank is raised on every rank (``what`` names the cache in that message).
    """
    import torch.distributed as dist

    error = None
    if builds_here() and not (Path(directory) / done).is_file():
        try:
            write_atomically(directory, write)
        except DataError as err:
            error = err
    if dist.is_initialized():  # also the barrier
        failed = [False] * dist.get_world_size()
        dist.all_gather_object(failed, error is not None)
        if any(failed) and error is None:
            raise DataError(f"building the {what} in {directory} failed on rank {failed.index(True)} (see its error)")
    if error is not None:
        raise error
