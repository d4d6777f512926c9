"""Cache directories: written atomically, built once, a build's DataError kept whole."""

from pathlib import Path

import numpy as np
import pytest

from loongforge.core.cache import build_once, write_atomically
from loongforge.llm.data.cache import save_token_arrays
from loongforge.llm.data.errors import DataError


def test_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "cache"

    def write(tmp: Path):
        (tmp / "half.npy").write_bytes(b"x")
        raise DataError("bad record")

    with pytest.raises(DataError, match="bad record"):
        write_atomically(target, write)
    assert list(tmp_path.iterdir()) == []


def test_a_copy_renamed_first_wins(tmp_path):
    target = tmp_path / "cache"
    write_atomically(target, lambda tmp: (tmp / "meta.json").write_text("first"))
    write_atomically(target, lambda tmp: (tmp / "meta.json").write_text("second"))  # lost the race
    assert (target / "meta.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no temporary left


def test_build_once_reuses_a_finished_directory(tmp_path):
    calls = []

    def write(tmp: Path):
        calls.append(tmp)
        (tmp / "meta.json").write_text("{}")

    for _ in range(2):
        build_once(tmp_path / "index", write, "test index")
    assert len(calls) == 1


def test_token_arrays_round_trip(tmp_path):
    ids = [np.array([5, 6, 7]), np.array([8])]
    masks = [np.array([0, 1, 1], dtype=bool), np.array([1], dtype=bool)]
    save_token_arrays(tmp_path, ids, masks)
    assert np.load(tmp_path / "tokens.npy").tolist() == [5, 6, 7, 8]
    assert np.load(tmp_path / "tokens.npy").dtype == np.int32
    assert np.load(tmp_path / "assistant.npy").tolist() == [False, True, True, True]
    assert np.load(tmp_path / "offsets.npy").tolist() == [0, 3, 4]
