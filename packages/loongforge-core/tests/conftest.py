"""Fixtures shared by the core package's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from compiled_vs_composed import assert_compiled_like_composed as _assert_compiled_like_composed


@pytest.fixture
def assert_compiled_like_composed() -> Callable:
    """An autograd function over registry ops, run eagerly or compiled, against autograd of the
    ops it replaces: ``assert_compiled_like_composed(loss, composed, fused, leaves, backend)``."""
    return _assert_compiled_like_composed
