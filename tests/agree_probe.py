"""A worker for ``tests/test_preemption.py``: two ranks (gloo) take "steps" as the loop does,
calling ``preemption.agreed_stop`` at every step boundary under ``StopSignals``; each writes the
step it stopped after and the signal it stopped on to ``OUT/rank-R.json``."""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge.core.training.preemption import StopSignals, agreed_stop

if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    step, stop = 0, 0
    with StopSignals() as signals:
        (out / f"ready-{rank}").touch()
        while step < 2000:
            stop = agreed_stop(signals.received, torch.device("cpu"))
            if stop:
                break
            time.sleep(0.01 * (1 + rank))  # ranks at different speeds: the collective lines them up
            step += 1
    (out / f"rank-{rank}.json").write_text(json.dumps({"step": step, "signal": stop, "received": signals.received}))
    dist.destroy_process_group()
