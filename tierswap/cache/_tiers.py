"""The books of one memory tier: its entries, and the bytes its engine ledger holds for them.

Private to :mod:`tierswap.cache`. Nothing here takes the cache's lock on its own: the cache holds
it around every call (the ledger takes the same, reentrant, lock again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from tierswap.engine import Ledger, ResidentSet
from tierswap.engine.policies import EvictionPolicy
from tierswap.io import footprint
from tierswap.tiers import MEMORY_TIERS, TierName

if TYPE_CHECKING:
    from tierswap.store import ArrayInfo

TIERS = MEMORY_TIERS

LOADING = "loading"  # bytes reserved, a read (or a copy from the other tier) fills the tensor
READY = "ready"  # the tensor holds the item's value
FLUSHING = "flushing"  # ready, and a flush is writing it to the store (not evictable meanwhile)
FAILED = "failed"  # the read failed; `error` says why (the entry is no longer in its tier)


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

    @classmethod
    def of_info(cls, info: ArrayInfo) -> Meta:
        """What the store says of an item (:meth:`~tierswap.SwapStore.info`)."""
        return cls(info.dtype, tuple(info.shape), info.nbytes)


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
    """An item whose bytes in ``tier`` stay counted until its I/O ends: a dirty item evicted,
    until the store has it, or an item moving to the other tier, until the copy has read it."""

    entry: Entry
    for_key: str | None = None  # whose read the freed bytes are set aside for
    # a write-through of a key with no dirty entry: ``entry`` wraps the caller's tensor and
    # counts in no tier
    through: bool = False


class Tier:
    """One memory tier of a cache: a :class:`~tierswap.engine.Ledger` (``used``, ``budget`` and the
    counters; every change of ``used`` is one of its calls) and what its bytes are held for:

    - ``resident``: the entries' sizes (ready, being read in or flushed): the tier's
      :class:`~tierswap.engine.ResidentSet`;
    - ``writing``: bytes that leave once their I/O ends: dirty victims being written down, and
      entries moving to the other tier until their copy has read them;
    - ``promised``: the part of ``writing`` evicted to make room for a key, by that key;
    - ``earmarks``: bytes of written victims set aside for the key they were evicted for, until
      its read takes them (so a read never takes room another one waits for).

    **Invariant**, checked after every change::

        resident + writing + sum(earmarks) <= used <= budget
        sum(promised) <= writing;   every earmark and promise > 0;   demand_waiting >= 0

    with equality on the left whenever the cache's lock is free (:meth:`balanced`).
    ``demand_waiting`` counts callers blocked until bytes free up here (they go before
    prefetches)."""

    def __init__(
        self, name: TierName, budget: int, cv: threading.Condition, device: torch.device
    ) -> None:
        self.name = name
        self.ledger = Ledger(name, budget, cv)
        self.device = device  # where this tier's buffers live (the CPU for host memory)
        self.entries: ResidentSet[str, Entry] = ResidentSet(self.ledger)
        self.writing = 0
        self.promised: dict[str, int] = {}
        self.earmarks: dict[str, int] = {}
        self.demand_waiting = 0

    # ------------------------------------------------------------ what the ledger holds
    @property
    def resident(self) -> int:
        return self.entries.nbytes

    @property
    def budget(self) -> int:
        return self.ledger.budget

    @property
    def used(self) -> int:
        return self.ledger.used

    @property
    def free(self) -> int:
        return self.ledger.free

    @property
    def enabled(self) -> bool:
        return self.ledger.budget > 0

    def room(self, key: str | None) -> int:
        """Bytes ``key`` may take now: the free bytes and those earmarked for it."""
        return self.ledger.free + (self.earmarks.get(key, 0) if key is not None else 0)

    def coming(self, key: str, size: int) -> bool:
        """True when the room ``key`` needs is free, earmarked, or on its way (write-backs)."""
        return self.room(key) + self.promised.get(key, 0) >= size

    def take(self, size: int, key: str | None = None) -> bool:
        """Reserve ``size`` bytes, first out of those earmarked for ``key`` (the rest of its
        earmark is freed); ``False`` when they are not there."""
        if self.room(key) < size:
            return False
        mine = self.earmarks.pop(key, 0) if key is not None else 0
        if size >= mine:
            taken = self.ledger.try_reserve(size - mine)
        else:
            self.ledger.release(mine - size)
            taken = True
        self.check()
        return taken

    def untake(self, size: int) -> None:
        """Return ``size`` bytes taken (:meth:`take`) for an entry that never joined (its copy
        failed)."""
        self.ledger.release(size)
        self.check()

    # ------------------------------------------------------------ entries
    def add(self, entry: Entry) -> None:
        """``entry`` joins the tier; its bytes were reserved before (:meth:`take`)."""
        self.entries.keep(entry.key, entry, entry.size)
        self.check()

    def remove(self, entry: Entry) -> None:
        """``entry`` leaves the tier; its bytes stay reserved (the caller moves them on)."""
        self.entries.leave(entry.key)
        self.check()

    def discard(self, entry: Entry) -> None:
        """``entry`` leaves the tier and its bytes return to the budget."""
        self.entries.drop(entry.key)
        self.check()

    # ------------------------------------------------------------ write-backs
    def start_write(self, entry: Entry, for_key: str | None) -> None:
        """``entry`` leaves to be written down; its bytes count until the write ends, promised
        to ``for_key`` when it was evicted to make room for that key."""
        self.remove(entry)
        self.writing += entry.size
        if for_key is not None:
            self.promised[for_key] = self.promised.get(for_key, 0) + entry.size
        self.check()

    def end_write(self, wb: WriteBack, *, failed: bool, earmark: bool) -> None:
        """A write-back (or move) ended: a failed one's entry comes back; a written victim's
        bytes are earmarked for the key it made room for (``earmark``), or freed."""
        size, for_key = wb.entry.size, wb.for_key
        self.writing -= size
        if for_key is not None:
            self.promised[for_key] -= size
            if not self.promised[for_key]:
                del self.promised[for_key]
        if failed:
            self.add(wb.entry)
        elif earmark and for_key is not None:
            self.earmarks[for_key] = self.earmarks.get(for_key, 0) + size
            self.check()
        else:
            self.ledger.release(size)
            self.check()

    def release_earmarks(self, keep: Callable[[str], bool]) -> bool:
        """Free the bytes earmarked for keys ``keep`` rejects; whether there were any."""
        dropped = [key for key in self.earmarks if not keep(key)]
        for key in dropped:
            self.ledger.release(self.earmarks.pop(key))
        self.check()
        return bool(dropped)

    @contextlib.contextmanager
    def demanded(self) -> Iterator[None]:
        """Count a caller blocked until bytes free up here, for the block."""
        self.demand_waiting += 1
        try:
            yield
        finally:
            self.demand_waiting -= 1
            self.check()

    def clear(self) -> None:
        """Drop every entry and earmark and free their bytes (the cache is closing, settled)."""
        if not self.balanced():
            raise AssertionError(f"{self.name} tier: books out of balance at close: {self!r}")
        self.entries.clear()
        self.earmarks.clear()
        self.ledger.release(self.ledger.used)

    # ------------------------------------------------------------ the invariant
    def check(self) -> None:
        """Raise when the invariant in the class docstring does not hold."""
        earmarked = sum(self.earmarks.values())
        ok = (
            min(self.resident, self.writing, self.demand_waiting) >= 0
            and self.resident + self.writing + earmarked <= self.ledger.used
            and sum(self.promised.values()) <= self.writing
            and all(n > 0 for n in (*self.earmarks.values(), *self.promised.values()))
        )
        if not ok:
            raise AssertionError(f"{self.name} tier: books out of balance: {self!r}")

    def balanced(self) -> bool:
        """The invariant's settled form, recounted from the entries: every byte the ledger holds
        is an entry's, a write-back's or an earmark's (true whenever the lock is free)."""
        held = sum(e.size for e in self.entries.values())
        total = held + self.writing + sum(self.earmarks.values())
        return held == self.resident and total == self.ledger.used

    def __repr__(self) -> str:
        books = ("used", "budget", "resident", "writing", "earmarks", "promised", "demand_waiting")
        return f"Tier({self.name}, {', '.join(f'{k}={getattr(self, k)}' for k in books)})"

    # ------------------------------------------------------------ choosing victims
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
        Without ``strict`` only evictable entries (ready, not held) are candidates. With ``strict``
        every entry is, and the answer is ``None`` when the policy's choice is not evictable right
        now: a prefetch then waits rather than settle for a worse victim."""
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
