"""Give freed heap memory back to the operating system after the state is created.

The first step creates each slice's state with ``torch.zeros_like`` (torch's own lazy init),
writes it to the store and frees it. glibc keeps such freed blocks in
its heap (after the first large ``free`` it raises its mmap threshold), which would add up to a
slice's worth of retained memory, often more through fragmentation, on top of the host
budget. ``malloc_trim(0)`` returns whole free pages; it costs well under a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["fix_mmap_threshold", "trim_heap"]

#: glibc's ``mallopt`` parameter number of the mmap threshold.
_M_MMAP_THRESHOLD = -3
#: Allocations at least this large get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


def fix_mmap_threshold() -> None:
    """Pin glibc's mmap threshold at :data:`MMAP_THRESHOLD` (process-wide, once).

    By default glibc raises the threshold to the size of the largest mapped block freed so far
    (up to 32 MiB), after which a step's slice-sized transients (torch's own temporaries, the
    first step's new state) come from the heap and stay resident when freed: measured here,
    about 250 MiB above the budget for 40 parameters of 1M elements. A fixed threshold keeps
    such blocks in their own mappings, so freeing one gives its memory back at once.
    """
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim_heap() -> None:
    """Return free heap pages to the OS where the C library can (glibc); else do nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
