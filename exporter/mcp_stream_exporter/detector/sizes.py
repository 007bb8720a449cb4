"""What CPython takes for the strings and tuples the detector keeps, by arithmetic.

``sys.getsizeof`` looks up and calls ``__sizeof__`` (about 0.2 µs), and the ledger and the timelines size a
dozen values for every event they keep: an ASCII string is a fixed header and a byte a character, a tuple a
header and a pointer an item, so one ``isascii`` over them all replaces the calls. The figures are
CPython's own (taken at import), and a string that is not ASCII is still asked.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

STR = sys.getsizeof("")  # an ASCII string, before its characters
TUPLE = sys.getsizeof(())  # a tuple (its GC header included), before its items
ITEM = sys.getsizeof((None,)) - TUPLE


def strings(values: Iterable[str]) -> int:
    """Bytes of ``values``, each counted (a string held twice is counted twice: an upper bound)."""
    held = values if isinstance(values, (list, tuple)) else list(values)
    joined = "".join(held)
    if joined.isascii():
        return STR * len(held) + len(joined)
    return sum(map(sys.getsizeof, held))


def strings_tuple(values: tuple[str, ...]) -> int:
    """Bytes of a tuple of strings and of its strings."""
    return TUPLE + ITEM * len(values) + strings(values)
