"""Stopping a run when asked: a scheduler's preemption (SIGTERM, or SIGUSR1 sent ahead of time,
as SLURM's ``--signal=USR1@SECONDS`` does) and Ctrl-C (SIGINT).

While ``Trainer.fit`` runs, ``StopSignals`` holds the handlers of these signals (the previous ones
come back when it ends). A signal only records the request; the loop reads it at each step
boundary, where every rank takes part in ``agreed_stop`` (the largest signal number any rank
received, all-reduced over the job), so a signal that reaches one rank stops all of them after the
same step and no rank waits in a collective for another. The loop then saves a checkpoint of that
step through the normal atomic path (when a step has finished since the last one), says so in one
line and leaves with ``TrainingStopped``, whose exit code a scheduler can act on:

- SIGTERM, SIGUSR1: ``REQUEUE_EXIT_CODE`` (75, sysexits' EX_TEMPFAIL, "try again later"): the run
  is whole on disk and the same command continues it;
- SIGINT: 130 (128 + SIGINT, what a shell reports for Ctrl-C).

A second signal stops the process at once, without a checkpoint (the signal's default action;
the last checkpoint stays whole, since saves are atomic). The same signal again within
``REPEAT_WINDOW_S`` of the first counts as the same request: SLURM signals every process of a job
step and the ``--nproc-per-node`` launcher forwards what it gets, so a worker may receive one
request twice.
"""

from __future__ import annotations

import os
import signal
from abc import ABC, abstractmethod
import threading
import time
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: stopped whole by a scheduler's signal; run the same command again
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT  # 130: Ctrl-C
REPEAT_WINDOW_S = 2.0


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``."""
    return INTERRUPT_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE


def describe(signum: int) -> str:
    """``signum`` as the line that reports it names it: ``Ctrl-C`` for SIGINT, else its name."""
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


@contextmanager
def handling(handler, signals=STOP_SIGNALS):
    """``handler`` takes ``signals`` while entered, and the previous handlers come back on exit.
    Only in the main thread, where Python runs signal handlers; elsewhere nothing changes."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


class SignalScope(ABC):
    """Its ``_handle(signum, frame)`` (what a subclass does with a signal) takes the stop signals while it is entered (``handling``);
    ``received``: the first one's number (0 while none came)."""

    def __init__(self):
        self.received = 0
        self._scope = None

    def __enter__(self):
        self._scope = handling(self._handle)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._scope.__exit__(*exc)

    @abstractmethod
    def _handle(self, signum: int, frame) -> None: ...


class StopSignals(SignalScope):
    """The loop's stop requests: the first is recorded, the same one again within
    ``REPEAT_WINDOW_S`` is ignored, another stops the process at once."""

    def __init__(self):
        super().__init__()
        self._first_at = 0.0

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self._first_at = signum, now
            return
        if signum == self.received and now - self._first_at < REPEAT_WINDOW_S:
            return  # the same request, delivered twice
        # a second request: the signal's default action, now (os.write: no buffered I/O in a handler)
        os.write(2, f"{describe(signum)} again: stopping at once, without a checkpoint\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def agreed_stop(requested: int, device) -> int:
    """The signal every rank stops on at this step boundary: the largest any rank received (0: go
    on). Every rank of the job calls it at the same boundary."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return requested
    flag = torch.tensor([requested], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
