"""Start the subprocess runs of the selected loongforge-xpu tests together, so they overlap.

A test module that launches other interpreters may define ``start_background_runs()``; it is
called once after collection for every such module that has a selected test, and the tests then
wait for their own processes.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def pytest_collection_finish(session):
    modules = {item.module for item in session.items if Path(str(item.path)).parent == HERE}
    for module in sorted(modules, key=lambda m: m.__name__):
        start = getattr(module, "start_background_runs", None)
        if start is not None:
            start()
