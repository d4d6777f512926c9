import os

import pytest
import torch

from loongforge.core.cache import ENV_VAR as CACHE_ENV

TEST_CLIPS = 12  # size of the built-in set the tests train on


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private cache for the built-in dataset, shared by all tests of the session."""
    path = tmp_path_factory.mktemp("diffusion-cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(scope="session")
def builtin_latents(cache_dir):
    """The preprocessed built-in set of ``TEST_CLIPS`` clips (its encoders are in ``../encoders``)."""
    from loongforge.diffusion.data.synthetic import builtin_dataset

    return builtin_dataset(TEST_CLIPS, show_progress=False)


@pytest.fixture(scope="session")
def synthetic_overrides(builtin_latents):
    """Overrides that make `lf-diffusion train` use the test-sized built-in set."""
    return [f"data.synthetic_clips={TEST_CLIPS}", "log.progress=false", "log.tensorboard=true"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
