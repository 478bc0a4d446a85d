"""tierswap: tiered GPU / pinned host / NVMe swap space and offloaded optimizers for PyTorch."""

from __future__ import annotations

from tierswap import errors
from tierswap.cache import CacheStats, LookaheadPolicy, LRUPolicy, TierCache
from tierswap.config import IOConfig, parse_size
from tierswap.optim import SwapOptimizer, offload, swapped
from tierswap.pipeline import Job, Pipeline, Region
from tierswap.store import ArrayInfo, SwapStore

__all__ = [
    "ArrayInfo",
    "CacheStats",
    "IOConfig",
    "Job",
    "LRUPolicy",
    "LookaheadPolicy",
    "Pipeline",
    "Region",
    "SwapOptimizer",
    "SwapStore",
    "TierCache",
    "errors",
    "offload",
    "parse_size",
    "swapped",
]
__version__ = "0.1.0"
