"""The one movement engine under :class:`~tierswap.Pipeline` and :class:`~tierswap.TierCache`.

Both front ends compose the same parts: a byte :class:`Ledger` per memory tier (its invariant:
``0 <= used <= budget``, every byte reserved before it is allocated), a :class:`BufferPool` of
page-aligned (pinned on CUDA) buffers per tier, the eviction policies that choose what stays
resident (:mod:`~tierswap.engine.policies`, and :func:`place` for a cyclic schedule) and the
book of what is (:class:`ResidentSet`, one per tier), one
allocator for a tier's buffers (:func:`allocate`: the pool's, and the cache's items), and one
statistics type (:class:`TierStats`, :class:`CacheStats`), and the transfers: disk <-> host
through one :class:`Disk` per front end (reads into reserved buffers, write-behind raised
once, reads ordered after the writes they overlap), host <-> device through
:mod:`~tierswap.engine.transfer`
(side streams and events on CUDA; :class:`DeviceStaging` keeps a front end's work on the
device within the device ledger). Nothing here imports a front end.
"""

from __future__ import annotations

from tierswap.engine._disk import (
    Disk,
    Region,
    StoreProtocol,
    Target,
    nbytes_of,
    overlap,
)
from tierswap.engine._ledger import Ledger
from tierswap.engine._placement import kept, place
from tierswap.engine._pool import BufferPool, allocate, base_bytes
from tierswap.engine._resident import ResidentSet
from tierswap.engine._staging import DeviceStaging, Staged
from tierswap.engine.belady import CycleReads, simulate
from tierswap.engine.policies import (
    EvictionPolicy,
    LookaheadPolicy,
    LRUPolicy,
    ScheduledPolicy,
    make_policy,
    policy_per_tier,
)
from tierswap.engine.stats import CacheStats, TierStats
from tierswap.engine.transfer import (
    CudaTransfers,
    PassThrough,
    ToDevice,
    ToHost,
    Transfers,
    completed,
    to_host_all,
    transfers_for,
)

__all__ = [
    "BufferPool",
    "CacheStats",
    "CudaTransfers",
    "CycleReads",
    "DeviceStaging",
    "Disk",
    "EvictionPolicy",
    "LRUPolicy",
    "Ledger",
    "LookaheadPolicy",
    "PassThrough",
    "Region",
    "ResidentSet",
    "ScheduledPolicy",
    "Staged",
    "StoreProtocol",
    "Target",
    "TierStats",
    "ToDevice",
    "ToHost",
    "Transfers",
    "allocate",
    "base_bytes",
    "completed",
    "kept",
    "make_policy",
    "nbytes_of",
    "overlap",
    "place",
    "policy_per_tier",
    "simulate",
    "to_host_all",
    "transfers_for",
]
