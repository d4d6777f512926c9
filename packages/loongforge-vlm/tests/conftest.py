"""Fixtures of the loongforge-vlm tests."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

# init_parallel sets these for a world of one; a later subprocess would inherit a port still in use
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK")


@contextmanager
def rendezvous_env_kept():
    saved = {k: os.environ.get(k) for k in RENDEZVOUS}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _restore_rendezvous_env():
    """In-process training runs leave no rendezvous variables behind for the next test."""
    with rendezvous_env_kept():
        yield


@pytest.fixture(scope="module")
def megatron_world():
    """A megatron-core world of one process (gloo on CPU) for building models in-process."""
    from loongforge.core.parallel import destroy_parallel, init_parallel

    with rendezvous_env_kept():
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

