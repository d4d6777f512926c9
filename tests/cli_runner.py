"""Running the lf-* console scripts from tests (torchrun for several processes)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
BINDIR = Path(sys.executable).parent


def cli_env(env: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


def assert_one_error_line(err: str, *names: str) -> str:
    """stderr holds exactly one ``error:`` line, it names every one of ``names``, and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def run_cli(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an ``lf-*`` console script (under torchrun when ``nproc > 1``) and return the result."""
    if nproc > 1:
        cmd = [str(BINDIR / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(BINDIR / args[0]), *args[1:]]
    else:
        cmd = [str(BINDIR / args[0]), *args[1:]]
    proc = subprocess.run(cmd, env=cli_env(env), capture_output=True, text=True, timeout=timeout)
    return proc


def run_script(script: Path, args: list[str], nproc: int = 1, env: dict | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a Python script (a test's worker; under torchrun when ``nproc > 1``) and return the result."""
    if nproc > 1:
        cmd = [str(BINDIR / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
    else:
        cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, env=cli_env(env), capture_output=True, text=True, timeout=timeout)


class Job:
    """The ``nproc`` processes of one ``lf-*`` run, started like torchrun starts them (``RANK``,
    ``WORLD_SIZE``, ``MASTER_*`` in the environment) but all in one new process group, so that
    ``kill()`` takes the whole job down at once with SIGKILL, as a crashed node would."""

    def __init__(self, args: list[str], nproc: int = 1, env: dict | None = None, log_dir: Path | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        for rank in range(nproc):
            dist_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            log = open(Path(log_dir) / f"rank{rank}.log", "w") if log_dir else subprocess.DEVNULL
            self.logs.append(log)
            group = self.procs[0].pid if self.procs else 0
            self.procs.append(subprocess.Popen([str(BINDIR / args[0]), *args[1:]], env=cli_env({**(env or {}), **dist_env}),
                                               stdout=log, stderr=subprocess.STDOUT, process_group=group))

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self) -> list[int]:
        """SIGKILL the process group; returns the exit codes."""
        try:
            os.killpg(self.procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:  # every process already exited
            pass
        return self.wait()

    def wait(self, timeout: float | None = None) -> list[int]:
        codes = [p.wait(timeout) for p in self.procs]
        for log in self.logs:
            if log is not subprocess.DEVNULL:
                log.close()
        return codes
