"""A run directory's one owner (``RUN_DIR/run.lock``) and the record a run starts from
(``metrics.cut_back``)."""

import json
import os

import pytest

from loongforge.core.errors import UserError
from loongforge.core.metrics import cut_back
from loongforge.core.training.run_dir import RunDirBusyError, RunDirLock, check_directory


def test_a_held_run_dir_is_refused_and_free_again_once_released(tmp_path):
    """The lock is a ``flock`` of the open file: a second opener is refused even in the same process."""
    first = RunDirLock(tmp_path / "run")
    assert first.acquire() is None
    holder = json.loads((tmp_path / "run" / "run.lock").read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(RunDirBusyError, match=rf"log.run_dir={tmp_path / 'run'} is in use by pid {os.getpid()}"):
        RunDirLock(tmp_path / "run").acquire()
    first.release()
    assert not (tmp_path / "run" / "run.lock").exists()
    with RunDirLock(tmp_path / "run"):  # free again
        pass


def test_a_lock_file_nobody_holds_is_taken_over_naming_its_writer(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 999999, "host": "h", "command": "lf-llm train",
                                                   "started": 0.0}))
    lock = RunDirLock(tmp_path)
    previous = lock.acquire()
    assert (previous.pid, previous.host, previous.command) == (999999, "h", "lf-llm train")
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_directory_key_at_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    check_directory(tmp_path / "new" / "dir", "log.run_dir")  # not there yet: fine
    with pytest.raises(UserError, match=r"checkpoint.dir=.*/f is a file, not a directory"):
        check_directory(tmp_path / "f", "checkpoint.dir")
    with pytest.raises(UserError, match=r"log.run_dir=.*/f/sub lies under .*/f, which is a file"):
        check_directory(tmp_path / "f" / "sub", "log.run_dir")


def test_cut_back_keeps_whole_records_up_to_the_step_and_the_old_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(lines))
    assert cut_back(path, 3) is None and cut_back(path, 5) is None  # nothing past the step: untouched
    path.write_text("".join(lines) + '{"step": 4, "lo')  # a crash mid-line
    assert cut_back(path, 4) == tmp_path / "metrics.jsonl.bak-1"
    assert path.read_text() == "".join(lines)
    assert cut_back(path, 1) == tmp_path / "metrics.jsonl.bak-2"
    assert path.read_text() == lines[0]
    assert (tmp_path / "metrics.jsonl.bak-2").read_text() == "".join(lines)
    assert cut_back(path, 0) is not None and path.read_text() == ""
    assert cut_back(tmp_path / "absent.jsonl", 0) is None


def test_without_flock_a_holder_is_judged_by_its_pid(tmp_path):
    """What a file system that takes no ``flock`` leaves: a live pid on this host (or any holder on
    another host) keeps the directory; a gone one is taken over."""
    import socket
    import subprocess
    import sys

    def lock_file(pid: int, host: str) -> None:
        (tmp_path / "run.lock").write_text(json.dumps({"pid": pid, "host": host, "command": "x", "started": 0.0}))

    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        lock_file(alive.pid, socket.gethostname())
        with pytest.raises(RunDirBusyError, match=f"pid {alive.pid}"):
            RunDirLock(tmp_path, use_flock=False).acquire()
        lock_file(alive.pid, "another-host")
        with pytest.raises(RunDirBusyError, match=r"another-host .* \(if it is gone, delete .*run.lock\)"):
            RunDirLock(tmp_path, use_flock=False).acquire()
    finally:
        alive.stdin.close()
        alive.wait()
    lock_file(int(gone.stdout), socket.gethostname())
    lock = RunDirLock(tmp_path, use_flock=False)
    assert lock.acquire().pid == int(gone.stdout)
    lock.release()
    assert not (tmp_path / "run.lock").exists()
