"""The token arrays of the text-data caches (preprocessed corpora, token indexes).

A cache directory is named by a hash of its inputs, so an existing one is reused as it is; it is
built once per node and renamed into place when complete (``loongforge.core.cache.build_once``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def save_token_arrays(directory: Path, ids: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> None:
    """Token sequences and their assistant masks as ``tokens.npy`` (int32), ``assistant.npy`` and
    ``offsets.npy`` (int64, ``len(ids) + 1`` bounds) in ``directory``."""
    lengths = [len(x) for x in ids]
    np.save(directory / "tokens.npy", np.concatenate(ids).astype(np.int32))
    np.save(directory / "assistant.npy", np.concatenate(masks))
    np.save(directory / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
