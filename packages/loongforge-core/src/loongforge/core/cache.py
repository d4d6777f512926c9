"""Where every derived file goes (tokenized corpora, sample indices, generated demo datasets):
``$LOONGFORGE_CACHE`` when set, else ``$XDG_CACHE_HOME/loongforge``, else ``~/.cache/loongforge``.
A config key that names a cache directory (``data.cache_dir``) defaults to a folder in it."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "LOONGFORGE_CACHE"


def cache_root() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "loongforge"


def cache_dir(*parts: str) -> Path:
    """``cache_root() / parts...`` (not created here)."""
    return cache_root().joinpath(*parts)
