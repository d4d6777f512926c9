"""Running the lf-* console scripts from tests (torchrun for several processes)."""

import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an ``lf-*`` console script (under torchrun when ``nproc > 1``) and return the result."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    bindir = Path(sys.executable).parent
    if nproc > 1:
        cmd = [str(bindir / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(bindir / args[0]), *args[1:]]
    else:
        cmd = [str(bindir / args[0]), *args[1:]]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc
