"""The loongforge-core tests (helpers live in core_helpers.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # core_helpers


@pytest.fixture(scope="module")
def world():
    """One process's parallel context for the PyTorch-native engine, for a test module."""
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(seed=0, engine="torch")
    yield ctx
    destroy_parallel()
