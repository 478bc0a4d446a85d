"""What the engine's front ends (:class:`~tierswap.TierCache`, :class:`~tierswap.Pipeline` and
the optimizer on it) report: per tier hits, misses, bytes held and moved; disk traffic; stalls."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tierswap.tiers import DEVICE, HOST, NVME

if TYPE_CHECKING:
    from tierswap.engine._ledger import Ledger

__all__ = ["CacheStats", "TierStats"]


@dataclasses.dataclass(frozen=True)
class TierStats:
    """One memory tier (device or host) at the moment the stats were taken. ``used`` counts every
    byte the tier holds or has reserved (resident items, reads in flight into it, dirty items
    being written down); it never exceeds ``budget``."""

    hits: int = 0
    misses: int = 0
    used: int = 0
    budget: int = 0
    bytes_in: int = 0  # bytes moved into the tier (reads from below, copies from the other tier)
    bytes_out: int = 0  # bytes moved out of it (written down, copied to the other tier)
    peak: int = 0  # the most ``used`` has been since the tier was made

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """A snapshot of a front end's counters since it was made: the one shape of
    :meth:`TierCache.stats`, :meth:`Pipeline.stats` and (as a dict)
    :meth:`SwapOptimizer.tier_stats`.

    ``device``, ``host``: per-tier counters (:class:`TierStats`); a use at a tier is a hit when
    the item is resident there or being read into it. ``nvme_bytes_read`` / ``nvme_bytes_written``
    and ``nvme_reads`` / ``nvme_writes``: bytes and chunk files the store read and wrote
    (:meth:`~tierswap.engine.Disk.traffic`; the store's own counters, so other users of the store
    count too). ``nvme_bytes_forwarded``: bytes of reads served from writes still in flight,
    which the store did not read. ``stall_seconds``: time callers spent blocked on reads or
    write-backs in flight."""

    device: TierStats
    host: TierStats
    nvme_bytes_read: int = 0
    nvme_bytes_written: int = 0
    nvme_reads: int = 0
    nvme_writes: int = 0
    nvme_bytes_forwarded: int = 0
    stall_seconds: float = 0.0

    @classmethod
    def of(
        cls, device: Ledger, host: Ledger, traffic: Mapping[str, int], stall_seconds: float
    ) -> CacheStats:
        """The stats of a front end with these ledgers and disk ``traffic``."""
        return cls(
            device=device.stats(),
            host=host.stats(),
            nvme_bytes_read=traffic.get("bytes_read", 0),
            nvme_bytes_written=traffic.get("bytes_written", 0),
            nvme_reads=traffic.get("reads", 0),
            nvme_writes=traffic.get("writes", 0),
            nvme_bytes_forwarded=traffic.get("bytes_forwarded", 0),
            stall_seconds=stall_seconds,
        )

    def as_dict(self) -> dict[str, Any]:
        """``{"device": {...}, "host": {...}, "nvme": {...}, "stall_seconds": s}``."""
        return {
            DEVICE: self.device.as_dict(),
            HOST: self.host.as_dict(),
            NVME: {
                "bytes_read": self.nvme_bytes_read,
                "bytes_written": self.nvme_bytes_written,
                "reads": self.nvme_reads,
                "writes": self.nvme_writes,
                "bytes_forwarded": self.nvme_bytes_forwarded,
            },
            "stall_seconds": self.stall_seconds,
        }
