"""The tier cache: device / host / NVMe tiers with byte budgets and pluggable eviction policies."""

from __future__ import annotations

from tierswap.cache.tiercache import TierCache
from tierswap.engine import (
    CacheStats,
    CycleReads,
    EvictionPolicy,
    LookaheadPolicy,
    LRUPolicy,
    TierStats,
    make_policy,
    simulate,
)

__all__ = [
    "CacheStats",
    "CycleReads",
    "EvictionPolicy",
    "LRUPolicy",
    "LookaheadPolicy",
    "TierCache",
    "TierStats",
    "make_policy",
    "simulate",
]
