"""Run the Triton kernels on CPU through Triton's interpreter.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted (and Triton
imports more of itself lazily at the first launch), so ``TRITON_INTERPRET=1`` is set here, before
any test imports a kernel module, and stays set for the process.
"""

from __future__ import annotations

import os
import sys

if "loongforge.kernels.launch" in sys.modules and not sys.modules["loongforge.kernels.launch"].INTERPRETED:
    raise RuntimeError(
        "loongforge.kernels was imported without TRITON_INTERPRET=1 before its tests; run "
        "packages/loongforge-kernels/tests in a pytest process that imports no kernel module earlier"
    )
os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Silence a numpy deprecation raised inside Triton's interpreter, for these tests only."""
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    quiet = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    for item in items:
        if str(item.path).startswith(here + os.sep):
            item.add_marker(quiet)
