"""Sequence helpers shared by the pure packages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix, by bisection on C-speed slice compares (no per-token Python loop).

    Slices only compare equal between sequences of the same type (a list never equals a tuple), so
    token sequences are compared as lists."""
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:  # the common case: the new prompt extends the old one
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
