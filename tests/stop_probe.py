"""A worker for ``tests/test_preemption.py``: waits for a stop signal under the loop's handler
(``preemption.StopSignals``), then exits as a stopped run does."""

import sys
import time
from pathlib import Path

from loongforge.core.training.preemption import StopSignals, exit_code

if __name__ == "__main__":
    import os

    out, rank = Path(sys.argv[1]), os.environ["RANK"]
    with StopSignals() as signals:
        (out / f"ready-{rank}").touch()
        deadline = time.monotonic() + 60
        while not signals.received and time.monotonic() < deadline:
            time.sleep(0.02)
    (out / f"stopped-{rank}").touch()
    sys.exit(exit_code(signals.received) if signals.received else 1)
