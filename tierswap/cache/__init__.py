"""The tier cache: device / host / NVMe tiers with byte budgets and pluggable eviction policies."""

from __future__ import annotations

from tierswap.cache.belady import CycleReads, simulate
from tierswap.cache.policies import EvictionPolicy, LookaheadPolicy, LRUPolicy, make_policy
from tierswap.cache.stats import CacheStats, TierStats
from tierswap.cache.tiercache import TierCache

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
