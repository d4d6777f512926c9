"""What a downstream team sees of loongforge-core: a version, type information, and modules that
say what they export."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import loongforge.core
from loongforge.core import config, parallel


def test_core_has_a_version_and_type_information():
    assert loongforge.core.__version__ == version("loongforge-core")
    assert (Path(loongforge.core.__file__).parent / "py.typed").is_file()


def test_public_modules_name_their_exports():
    for module in (config, parallel):
        assert module.__all__ and all(callable(getattr(module, name)) for name in module.__all__), module
    assert {"load_config", "ConfigError", "to_yaml"} <= set(config.__all__)
    assert {"init_parallel", "ParallelLayout"} <= set(parallel.__all__)
