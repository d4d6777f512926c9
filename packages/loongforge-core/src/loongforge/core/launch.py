"""``lf-X train --nproc-per-node N``: the job's N processes on this machine, started from the
``lf-X`` command itself by torch's elastic launcher (what ``torchrun --standalone`` runs).

The launching process checks the config and the layout against N first, so a bad key, value or
layout is one ``error:`` line before any worker starts. Each worker runs ``python -m MODULE``
with the same arguments, less ``--nproc-per-node``; a worker's error line is its own (the error
contract of ``loongforge.core.cli``), and the launcher adds nothing to it: torch's launcher
report (``ChildFailedError`` and its log records) is shown only under ``--verbose``. The exit code
is the first failing worker's (2 for a user's mistake, 1 for a stopped run or a bug); a worker
killed by a signal is one line naming its rank and the signal.

SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) sent to the launcher are forwarded to the workers
(``SignalForwarder``; the workers each run in a session of their own, so a terminal's Ctrl-C
reaches only the launcher), which stop together after a step with a checkpoint
(``loongforge.core.training.preemption``); the launcher then says in one line what it forwarded
and exits with the workers' code (75: requeue; 130: Ctrl-C).

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
from loongforge.core.training.preemption import SignalScope

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


class SignalForwarder(SignalScope):
    """While entered (in the main thread), the stop signals (``preemption.STOP_SIGNALS``) sent to
    this process go on to its workers: its child processes that run ``python -m module``.
    ``received``: the first one's number (0: none came). The previous handlers come back on exit."""

    def __init__(self, module: str):
        super().__init__()
        self.module = module

    def _handle(self, signum: int, frame) -> None:
        import psutil

        self.received = self.received or signum
        for child in psutil.Process().children():
            try:
                if self.module in child.cmdline():
                    child.send_signal(signum)
            except psutil.Error:  # it has just exited
                pass


def stopped_job(prog: str, signum: int, nproc: int, failure, report) -> int:
    """The exit code of a job whose launcher forwarded ``signum`` to its workers (``failure``: the
    launcher's ``ChildFailedError``, None when every worker ended normally), said in one line; a
    worker that failed on its own has said why, and its code is the job's."""
    from loongforge.core.training.preemption import INTERRUPT_EXIT_CODE, REQUEUE_EXIT_CODE, describe, exit_code

    codes = [f.exitcode for f in failure.failures.values()] if failure is not None else []
    own = [code for code in codes if code > 0 and code not in (REQUEUE_EXIT_CODE, INTERRUPT_EXIT_CODE)]
    if own:
        return own[0]
    if failure is None:
        what, code = "the run had finished", 0
    elif any(code > 0 for code in codes):
        what, code = "they stopped together after a step (the line above names the checkpoint)", exit_code(signum)
    else:
        what, code = "they stopped before training began (no checkpoint)", exit_code(signum)
    then = " (requeue)" if code == REQUEUE_EXIT_CODE else ""
    report(f"{prog}: {describe(signum)}: forwarded to the {nproc} workers; {what}; exit {code}{then}")
    return code


def launch_local(module: str, argv: Sequence[str], nproc: int, verbose: bool = False,
                 report=lambda line: print(line, file=sys.stderr, flush=True), prog: str = "launcher") -> int:
    """Run ``python -m module *argv`` as ``nproc`` workers of one job on this machine and return
    the job's exit code (0, or the first failing worker's; a stop signal's, ``stopped_job``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch's launcher handles only the signals the forwarder leaves alone (it would stop the workers
    # with SIGKILL 30 s after passing a signal on, whatever they were saving)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          signals_to_handle="SIGHUP,SIGQUIT")
    failure = None
    with quiet_launcher(verbose), SignalForwarder(module) as forwarded:
        try:
            elastic_launch(config, sys.executable)("-m", module, *argv)
        except ChildFailedError as exc:
            failure = exc
    if forwarded.received:
        return stopped_job(prog, forwarded.received, nproc, failure, report)
    if failure is None:
        return 0
    rank, first = failure.get_first_failure()
    if first.exitcode > 0:  # the worker said why on its own
        return first.exitcode
    report(f"error: rank {rank} was stopped by {signal_name(first.exitcode)} (pid {first.pid}); the job is stopped")
    return 1
