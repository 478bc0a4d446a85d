"""Give freed heap memory back to the operating system after the state is created.

The first step creates each partition's state with ``torch.zeros_like`` and the cache copies it
into its own page-aligned buffers; the originals are then freed. glibc keeps such freed blocks in
its heap (after the first large ``free`` it raises its mmap threshold), which would add up to a
partition's worth of retained memory, often more through fragmentation, on top of the host
budget. ``malloc_trim(0)`` returns whole free pages; it costs well under a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["trim_heap"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> None:
    """Return free heap pages to the OS where the C library can (glibc); else do nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
