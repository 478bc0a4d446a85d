"""The one movement engine under :class:`~tierswap.Pipeline` and :class:`~tierswap.TierCache`.

Both front ends compose these parts (docs/architecture.md draws them): a :class:`Ledger` and a
:class:`ResidentSet` per memory tier, the :class:`BufferPool` and :func:`allocate`, the eviction
policies (:mod:`~tierswap.engine.policies`; :func:`place` on a cyclic schedule), the statistics
types, one :class:`Disk` per front end (disk <-> host) and the transfers (host <-> device:
:mod:`~tierswap.engine.transfer`, :class:`DeviceStaging`). Nothing here imports a front end."""

from __future__ import annotations

from tierswap.engine._disk import (
    Disk,
    Region,
    StoreProtocol,
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
    make_policy,
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
    "Staged",
    "StoreProtocol",
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
    "simulate",
    "to_host_all",
    "transfers_for",
]
