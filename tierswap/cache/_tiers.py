"""Bookkeeping of one memory tier: its entries, its byte budget, and the choice of victims.

Private to :mod:`tierswap.cache`. Nothing here locks: :class:`TierCache` holds its lock around
every call.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from tierswap.config import ALIGN, round_up
from tierswap.engine.policies import EvictionPolicy
from tierswap.io import aligned_empty
from tierswap.tiers import HOST, MEMORY_TIERS, TierName

TIERS = MEMORY_TIERS

LOADING = "loading"  # bytes reserved, a read from the store is filling the tensor
READY = "ready"  # the tensor holds the item's value
FLUSHING = "flushing"  # ready, and a flush is writing it to the store (not evictable meanwhile)
FAILED = "failed"  # the read failed; `error` says why (the entry is no longer in its tier)


def footprint(nbytes: int) -> int:
    """Bytes an item occupies in a tier: buffers are whole 4 KiB pages (O_DIRECT alignment)."""
    return round_up(nbytes, ALIGN) if nbytes else 0


@dataclasses.dataclass(frozen=True)
class Meta:
    """What the cache knows about an item without holding it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def footprint(self) -> int:
        return footprint(self.nbytes)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Meta:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())


@dataclasses.dataclass(eq=False)
class Entry:
    """One item held (or being read into) a tier."""

    key: str
    meta: Meta
    tier: TierName
    tensor: torch.Tensor
    state: str = READY
    dirty: bool = False
    pinners: Counter[int] = dataclasses.field(default_factory=Counter)  # thread id -> pins
    claims: int = 0  # transient holds by the cache itself (a get returning it, a move)
    error: BaseException | None = None

    @property
    def size(self) -> int:
        return self.meta.footprint

    @property
    def pins(self) -> int:
        return sum(self.pinners.values())

    @property
    def held(self) -> bool:
        return self.pins > 0 or self.claims > 0


@dataclasses.dataclass(eq=False)
class WriteBack:
    """A dirty item evicted from ``tier`` whose bytes stay counted until the store has them."""

    entry: Entry
    for_key: str | None = None  # whose read the freed bytes are set aside for


class Tier:
    """A budget and the entries that use it (plus bytes of write-backs still in flight)."""

    def __init__(self, name: TierName, budget: int) -> None:
        self.name = name
        self.budget = budget
        self.used = 0  # resident + loading + writing back; never above budget
        self.writing = 0  # part of `used` that write-backs in flight will free
        self.demand_waiting = 0  # callers blocked until bytes free up here (they go first)
        # Bytes of dirty victims evicted to make room for a key: in flight (`promised`, part
        # of `writing`), then written and set aside for that key (`earmarks`, part of `used`).
        self.promised: dict[str, int] = {}
        self.earmarks: dict[str, int] = {}
        self.entries: dict[str, Entry] = {}
        self.hits = 0
        self.misses = 0
        self.bytes_in = 0  # read in from the store, or moved in from the other tier
        self.bytes_out = 0  # written down to the store, or moved out to the other tier

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def free(self) -> int:
        return self.budget - self.used

    def pinned_bytes(self) -> int:
        return sum(e.size for e in self.entries.values() if e.pins)

    def pin_holders(self) -> set[int]:
        """Ids of the threads holding pins in this tier."""
        return {tid for e in self.entries.values() for tid in e.pinners}

    def unsettled(self) -> bool:
        """True while some state change in flight may later free or unblock bytes here."""
        return self.writing > 0 or any(
            e.state in (LOADING, FLUSHING) or e.claims for e in self.entries.values()
        )

    def victim(
        self,
        policy: EvictionPolicy,
        incoming: str | None = None,
        *,
        clean_only: bool = False,
        strict: bool = False,
    ) -> Entry | None:
        """The entry the policy would evict (for ``incoming``, a prefetch), if evictable now.

        Without ``strict`` only evictable entries (ready, not held) are candidates. With
        ``strict`` every entry is, and the answer is ``None`` when the policy's choice is not
        evictable right now: a prefetch then waits rather than settle for a worse victim.
        """
        candidates = [
            key
            for key, e in self.entries.items()
            if strict or (e.state == READY and not e.held and not (clean_only and e.dirty))
        ]
        key = policy.victim(candidates, incoming)
        if key is None:
            return None
        entry = self.entries[key]
        if entry.state != READY or entry.held or (clean_only and entry.dirty):
            return None
        return entry

    def allocate(self, meta: Meta, device: torch.device) -> torch.Tensor:
        """A buffer for ``meta`` in this tier (the caller has reserved the bytes)."""
        if self.name == HOST or device.type == "cpu":
            return aligned_empty(meta.shape, meta.dtype, pin=None if self.name == HOST else False)
        return torch.empty(meta.shape, dtype=meta.dtype, device=device)
