"""Fixtures of the loongforge-vlm tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def megatron_world():
    """A megatron-core world of one process (gloo on CPU) for building models in-process."""
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(seed=1234)
    yield ctx
    destroy_parallel()


@pytest.fixture(scope="session")
def vlm_cache(tmp_path_factory):
    """One data cache (the generated shapes set and its index) for every test of the session."""
    from loongforge.vlm.data.shipped import shipped_dataset

    cache = tmp_path_factory.mktemp("vlm-data")
    shipped_dataset(cache)
    return cache

