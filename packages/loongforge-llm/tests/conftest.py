"""Fixtures of the loongforge-llm tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def megatron_world():
    """A megatron-core world of one process (gloo on CPU) for building layers and models in-process."""
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(seed=1234)
    yield ctx
    destroy_parallel()
