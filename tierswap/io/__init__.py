"""The I/O layer: positional reads and writes on a bounded thread pool, into aligned buffers.

This is the package-internal API: the names under ``__all__`` are the ones other tierswap
packages (the store, the pipeline, the cache, the CLI) may import, and they import them from
``tierswap.io``, never from its underscore modules (``make test`` checks this with
import-linter). None of them is part of tierswap's public API. The I/O layer knows nothing of the
store's layout: callers pass it the paths it reads and writes.
"""

from __future__ import annotations

from tierswap.io._buffers import aligned_empty, cuda_pinning_available, footprint, is_aligned
from tierswap.io._engine import IOEngine, crc_of, gather, translate_os_error, zeros_crc

__all__ = [
    "IOEngine",
    "aligned_empty",
    "crc_of",
    "cuda_pinning_available",
    "footprint",
    "gather",
    "is_aligned",
    "translate_os_error",
    "zeros_crc",
]
