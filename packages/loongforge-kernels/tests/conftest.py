"""The kernels' tests run on CPU through Triton's interpreter, which the repository's root
conftest.py switches on (``TRITON_INTERPRET=1``) before anything imports triton."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    """Silence a numpy deprecation raised inside Triton's interpreter, for these tests only."""
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    quiet = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    for item in items:
        if str(item.path).startswith(here + os.sep):
            item.add_marker(quiet)
