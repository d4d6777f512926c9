"""Fixtures of the loongforge-embodied tests (helpers live in embodied_helpers.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # embodied_helpers, lerobot_reference
os.environ.setdefault("LOONGFORGE_ACCELERATOR", "cpu")

from embodied_helpers import write_tiny_dataset  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("lerobot") / "tiny")
