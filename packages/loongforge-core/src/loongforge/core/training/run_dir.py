"""A run directory: its one owner (``RUN_DIR/run.lock``), and the directories a run writes.

A training run holds an exclusive ``flock`` on ``RUN_DIR/run.lock`` for as long as it runs (global
rank 0 takes it for the job). The file says who holds it (pid, host, command, start time), so a
second run into the same directory is refused with one line naming the holder
(``RunDirBusyError``). The kernel releases the ``flock`` when its process exits in any way (``kill
-9`` included), so a lock file left by a process that is gone is taken over by the next run, which
says whose it was; a run that ends normally removes the file. On a file system that takes no
``flock`` (Lustre mounted without it, some FUSE file systems) the holder is judged by its pid
instead: alive on this host, or on another host (which cannot be asked), it keeps the directory.

``check_directory`` refuses, before anything is written, a directory key (``log.run_dir``,
``checkpoint.dir``) that names a file or a path under one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loongforge.core.errors import UserError

LOCK_FILE = "run.lock"
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # a file system that takes no flock


class RunDirBusyError(UserError):
    """Another live process trains in this run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory."""

    pid: int
    host: str
    command: str
    started: float

    @classmethod
    def of_this_process(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), time.time())

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            doc = json.loads(text)
            return cls(int(doc["pid"]), str(doc["host"]), str(doc["command"]), float(doc["started"]))
        except (ValueError, KeyError, TypeError):  # empty (its holder is still writing it) or not ours
            return None

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "command": self.command, "started": self.started}) + "\n"

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (`{self.command}`, since {since})"


class RunDirLock:
    """``acquire()`` makes this process the owner of ``run_dir`` (creating it); ``release()`` gives
    it up. ``key`` is the config key that named the directory (for the error messages)."""

    def __init__(self, run_dir: str | Path, key: str = "log.run_dir", use_flock: bool = True):
        """``use_flock=False`` judges a holder by its pid alone (what a file system without ``flock``
        leaves)."""
        self.run_dir, self.key, self.use_flock = Path(run_dir), key, use_flock
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> Holder | None:
        """Take the directory; returns the earlier holder whose process is gone (its lock file was
        still there), else None. Raises ``RunDirBusyError`` naming the holder when it is alive."""
        check_directory(self.run_dir, self.key)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if not self.use_flock:
                    return self._take_by_pid(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Holder.parse(_read(fd))
                os.close(fd)
                raise self._busy(holder or "another process (starting up)") from None
            except OSError as exc:
                if exc.errno not in NO_FLOCK:
                    os.close(fd)
                    raise
                return self._take_by_pid(fd)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its holder unlinked while releasing it after we opened it
                break
            os.close(fd)
        return self._take(fd)

    def _take(self, fd: int) -> Holder | None:
        """Write this process into the lock file; returns who was in it before."""
        previous = Holder.parse(_read(fd))
        me = Holder.of_this_process().to_json().encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def _take_by_pid(self, fd: int) -> Holder | None:
        holder = Holder.parse(_read(fd))
        if holder is not None and holder.pid != os.getpid() and _maybe_alive(holder):
            os.close(fd)
            hint = "" if holder.host == socket.gethostname() else f" (if it is gone, delete {self.path})"
            raise self._busy(f"{holder}{hint}")
        return self._take(fd)

    def _busy(self, holder) -> RunDirBusyError:
        return RunDirBusyError(f"{self.key}={self.run_dir} is in use by {holder}: one run at a time trains in a run "
                               f"directory; wait for it to end or choose another {self.key}")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: the next owner opens a new file
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_directories(cfg) -> None:
    """``log.run_dir`` and ``checkpoint.dir`` of run config ``cfg`` can be directories."""
    check_directory(cfg.log.run_dir, "log.run_dir")
    if cfg.checkpoint.dir:
        check_directory(cfg.checkpoint.dir, "checkpoint.dir")


def check_directory(path: str | Path, key: str) -> None:
    """``path`` (named by config key ``key``) is a directory or can be made one: no file stands at
    it or at a folder above it."""
    path = Path(path)
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is a file" if candidate == path else f"lies under {candidate}, which is a file"
                raise UserError(f"{key}={path} {where}, not a directory")
            return


def _maybe_alive(holder: Holder) -> bool:
    """Whether the holder's process may still run: alive on this host, or on another one."""
    if holder.host != socket.gethostname():
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process of that pid
        return True
    return True


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
