"""Hugging Face Hub ids where a config takes a local path.

``model.init_from_hf`` (lf-llm), ``model.pretrained`` (lf-diffusion), ``model.pretrained`` and
``data.path`` (lf-embodied) accept ``owner/name`` (optionally ``owner/name@revision``) as well as a
path. ``resolve_local`` turns such an id into the directory of its snapshot through
``huggingface_hub``: from the hub cache first (``HF_HUB_CACHE`` / ``HF_HOME``, read when called),
downloading only when the snapshot is not cached and ``HF_HUB_OFFLINE`` is off. A value that is an
existing path is returned as it is; anything else is left for the caller to report (it names the
key either way). Resolution happens while the config is loaded, before any process group exists;
under ``torchrun`` every rank resolves the same id into the same cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import overload

from loongforge.core.config import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def is_hub_id(value: str) -> bool:
    return bool(HUB_ID.match(value)) and not Path(value).expanduser().exists()


def _offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


@overload
def resolve_local(value: str, *, key: str, repo_type: str = "model") -> str: ...
@overload
def resolve_local(value: None, *, key: str, repo_type: str = "model") -> None: ...
@overload
def resolve_local(value: str | None, *, key: str, repo_type: str = "model") -> str | None: ...
def resolve_local(value: str | None, *, key: str, repo_type: str = "model") -> str | None:
    """``value`` as a local path: itself when it exists (or is not shaped like a hub id), else the
    local snapshot of the hub repository it names (``repo_type``: model or dataset). An id that is
    neither cached nor downloadable is a ``ConfigError`` naming ``key``."""
    if not value or not is_hub_id(value):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    repo_id, _, revision = value.partition("@")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision or None, cache_dir=cache_dir,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass  # not cached
    except HFValidationError as exc:
        raise ConfigError(f"{key}={value}: not a valid Hugging Face {repo_type} id ({exc})") from exc
    if _offline():
        raise ConfigError(f"{key}={value}: neither a local path nor a {repo_type} in the Hugging Face cache, and "
                          f"HF_HUB_OFFLINE is set (download it first: hf download {repo_id}"
                          f"{' --repo-type dataset' if repo_type == 'dataset' else ''})")
    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision or None, cache_dir=cache_dir)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"{key}={value}: neither a local path nor a {repo_type} the Hugging Face Hub could give "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
