"""The error contract of every ``lf-*`` command.

``UserError`` is what a user can cause and fix: a config key or value, a data file, a checkpoint,
the accelerator asked for, a layout the world size cannot hold, a full disk. The CLIs print it as
one ``error: ...`` line naming the file, key or value and exit 2, with no traceback (``--debug`` or
``LOONGFORGE_DEBUG=1`` shows it). Anything else is a bug and keeps its traceback.

Each package's own error types (bad data, a mapping that cannot be applied, ...) derive from it, so
no CLI keeps a list of what to catch.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input, not a bug: printed as one ``error:`` line (exit 2)."""


class DataError(UserError, ValueError):
    """A data file, sample or dataset that cannot be used as given; the message names the file (and
    line, sample, episode or frame) and what is wrong with it."""


class OutputExistsError(UserError, FileExistsError):
    """An output path that exists already (conversions and exports write new files only)."""


class StorageError(UserError):
    """Writing or reading a file failed for a reason outside the program (disk full, read-only or
    permission denied); the message names the file and says what was kept."""


# errno values that mean "the file system refused", not "the program is wrong"
STORAGE_ERRNOS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
                  errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


def storage_error(exc: OSError, what: str) -> StorageError | None:
    """``exc`` as a ``StorageError`` (``what``: the file and what was kept), or None when its errno
    is not one of the file system's refusals."""
    reason = STORAGE_ERRNOS.get(exc.errno) if exc.errno is not None else None
    if reason is None:
        return None
    return StorageError(f"{what}: {reason}" + (f" ({exc.filename})" if exc.filename else ""))
