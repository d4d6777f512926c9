"""A worker for ``tests/test_launch.py``: rank 1 dies by SIGKILL, as an out-of-memory kill would;
the other ranks wait to be stopped by the launcher."""

import os
import signal
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
