"""Sort orders that are the same on every machine.

The plan must come out identical on every rank, so no ordering may depend on how a sort breaks
ties (numpy's fast sorts pick an algorithm by CPU features). Every order here breaks ties by
position: the keys are packed into one unique int64 per sample (a float key is quantised to the
bits left over, which only merges values within 2**-bits of the largest), so any correct sort
returns the same permutation. When the keys do not fit in 63 bits the stable ``numpy.lexsort``
is used instead.
"""

from __future__ import annotations

import numpy as np

MIN_VALUE_BITS = 24


def _bits(max_value: int) -> int:
    return max(1, int(max_value).bit_length())


def ordered(values: np.ndarray | None = None, *, groups: np.ndarray | None = None,
            descending: bool = True) -> np.ndarray:
    """Permutation by (``groups`` ascending, non-negative ``values`` descending or ascending, position)."""
    if values is not None:
        n = len(values)
    elif groups is not None:
        n = len(groups)
    else:
        raise ValueError("ordered: give values, groups or both")
    index_bits = _bits(max(n - 1, 1))
    group_bits = _bits(int(groups.max(initial=0))) if groups is not None else 0
    value_bits = min(52, 63 - index_bits - group_bits) if values is not None else 0
    if values is not None and value_bits < MIN_VALUE_BITS:
        keys = [np.arange(n)]
        keys.append(-values if descending else values)
        if groups is not None:
            keys.append(groups)
        return np.lexsort(keys)
    key = np.arange(n, dtype=np.int64)
    shift = index_bits
    if values is not None:
        if values.min(initial=0.0) < 0:
            raise ValueError("ordered() takes non-negative values")
        top = float(values.max(initial=0.0))
        scale = ((1 << value_bits) - 1) / top if top > 0 else 0.0
        q = np.floor(values * scale).astype(np.int64)
        if descending:
            q = ((1 << value_bits) - 1) - q
        key |= q << shift
        shift += value_bits
    if groups is not None:
        key |= groups.astype(np.int64) << shift
    return np.argsort(key)
