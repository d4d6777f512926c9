"""``lf-X train --nproc-per-node N``: the job's N processes on this machine, started from the
``lf-X`` command itself by torch's elastic launcher (what ``torchrun --standalone`` runs).

The launching process checks the config and the layout against N first, so a bad key, value or
layout is one ``error:`` line before any worker starts. Each worker runs ``python -m MODULE``
with the same arguments, less ``--nproc-per-node``; a worker's error line is its own (the error
contract of ``loongforge.core.cli``), and the launcher adds nothing to it: torch's launcher
report (``ChildFailedError`` and its log records) is shown only under ``--verbose``. The exit code
is the first failing worker's (2 for a user's mistake, 1 for a stopped run or a bug); a worker
killed by a signal is one line naming its rank and the signal.

One machine only; for several, start each node with ``torchrun`` as usual.
"""

from __future__ import annotations

import logging
import signal
import sys
import uuid
from collections.abc import Sequence
from contextlib import contextmanager

from loongforge.core.config import ConfigError

FLAG = "--nproc-per-node"


def worker_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc-per-node N`` (or ``--nproc-per-node=N``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == FLAG:
            skip = True
        elif not item.startswith(FLAG + "="):
            out.append(item)
    return out


def check_not_launched(nproc: int, world_size: int) -> None:
    """``--nproc-per-node`` in a process some launcher started already (``torchrun``, a scheduler)."""
    if world_size > 1:
        raise ConfigError(f"{FLAG} {nproc}: this process is already one of a job of {world_size} (WORLD_SIZE); "
                          f"start the job either with {FLAG} or with a launcher such as torchrun, not both")


@contextmanager
def quiet_launcher(verbose: bool):
    """torch's launcher logs every worker's start and failure at WARNING and ERROR (its loggers set
    their own levels); without ``verbose`` no record below CRITICAL is shown while it runs."""
    if verbose:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


def signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def launch_local(module: str, argv: Sequence[str], nproc: int, verbose: bool = False,
                 report=lambda line: print(line, file=sys.stderr, flush=True)) -> int:
    """Run ``python -m module *argv`` as ``nproc`` workers of one job on this machine and return
    the job's exit code (0, or the first failing worker's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    with quiet_launcher(verbose):
        try:
            elastic_launch(config, sys.executable)("-m", module, *argv)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            if failure.exitcode > 0:  # the worker said why on its own
                return failure.exitcode
            report(f"error: rank {rank} was stopped by {signal_name(failure.exitcode)} (pid {failure.pid}); "
                   f"the job is stopped")
            return 1
    return 0
