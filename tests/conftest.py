from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llm_data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llm-data")
