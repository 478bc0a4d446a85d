"""tierswap: tiered GPU / pinned host / NVMe swap space and offloaded optimizers for PyTorch."""

from __future__ import annotations

from tierswap import errors
from tierswap.cache import CacheStats, LookaheadPolicy, LRUPolicy, TierCache
from tierswap.config import IOConfig, parse_size

__all__ = [
    "CacheStats",
    "IOConfig",
    "LRUPolicy",
    "LookaheadPolicy",
    "TierCache",
    "errors",
    "parse_size",
]
__version__ = "0.1.0"
