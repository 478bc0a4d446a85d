"""The three-tier cache: device memory, page-aligned host memory, and the store on NVMe.

Every item lives in at most one memory tier at a time (the tiers are exclusive) and, once written
down, in the store. Budgets count whole 4 KiB pages and are hard limits: bytes being read in and
dirty bytes being written down count until the I/O finishes.

The public API and the get/put paths live here; budgets, eviction, prefetching and the I/O
plumbing in :mod:`tierswap.cache._core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from tierswap._lifetime import close_at_exit
from tierswap.cache._core import CacheCore, CacheStore
from tierswap.cache._tiers import (
    FAILED,
    FLUSHING,
    LOADING,
    READY,
    TIERS,
    Entry,
    Meta,
    Tier,
    WriteBack,
)
from tierswap.config import format_size, parse_size
from tierswap.engine.policies import EvictionPolicy, make_policy
from tierswap.engine.stats import CacheStats, TierStats
from tierswap.errors import (
    InvalidTensorError,
    KeyNotFoundError,
    PinnedError,
)
from tierswap.keys import validate_key
from tierswap.tiers import DEVICE, HOST, NVME, TierName

__all__ = ["TierCache"]


TierArg = Literal["device", "host"] | None
_DONE, _PENDING, _BLOCKED = "done", "pending", "blocked"  # outcomes of one prefetch attempt


class TierCache(CacheCore):
    """A byte-budgeted device / host cache over a :class:`~tierswap.SwapStore`.

    Parameters
    ----------
    store:
        The NVMe tier. The cache assumes it is the only writer of the keys it caches.
    device_budget, host_budget:
        Byte budgets (ints or strings like ``"2GiB"``); ``0`` turns a tier off.
    device:
        Where the device tier lives; default ``cuda`` when available, else CPU memory (an
        ordinary tier with its own budget, so every path runs without a GPU).
    policy:
        ``"lru"``, ``"lookahead"`` or an :class:`~tierswap.engine.policies.EvictionPolicy`.

    Notes
    -----
    Items larger than a tier's budget skip that tier when the cache places them itself
    (``put``/``get`` with ``tier=None``, prefetches, demotions); naming that tier explicitly
    raises :class:`~tierswap.errors.BudgetError`. ``get``, ``put``, ``prefetch`` and the rest
    are safe to call from many threads at once. A tensor returned by ``get`` stays valid until
    the item is evicted; to modify it in place, hold it with :meth:`pinned`, then call
    :meth:`mark_dirty`.
    """

    def __init__(
        self,
        store: CacheStore,
        *,
        device_budget: int | str,
        host_budget: int | str,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        default = "cuda" if torch.cuda.is_available() else "cpu"
        tiers: dict[TierName, Tier] = {
            DEVICE: Tier(DEVICE, parse_size(device_budget, name="device_budget")),
            HOST: Tier(HOST, parse_size(host_budget, name="host_budget")),
        }
        chosen = torch.device(device if device is not None else default)
        super().__init__(store, make_policy(policy), chosen, tiers)
        close_at_exit(self)

    # ----------------------------------------------------------------- public API
    def get(self, key: str, tier: TierArg = None) -> torch.Tensor:
        """The item's tensor at ``tier``, read or moved there first when needed (blocks).

        ``tier=None`` picks the device tier when it is on and the item fits, else host. At the host
        tier the cached buffer itself is returned (no copy): a later :meth:`put` of the key with
        the same shape writes into that buffer, under the caller. Clone it to keep the value.
        """
        with self._claimed(key, tier) as entry:
            return entry.tensor

    @contextlib.contextmanager
    def pinned(
        self, key: str, tier: TierArg = None, *, dirty: bool = False
    ) -> Iterator[torch.Tensor]:
        """Hold the item at ``tier`` for the ``with`` block; it is never evicted meanwhile.

        Modify the tensor in place inside the block and either call :meth:`mark_dirty` there
        or pass ``dirty=True`` (marks it on leaving the block). Once the block is left the item
        may be evicted at any moment, so marking it afterwards can be too late. Raises
        :class:`~tierswap.errors.BudgetError` when pinned items would exceed the budget.
        """
        me = threading.get_ident()
        with self._claimed(key, tier) as entry, self._cv:
            entry.pinners[me] += 1
        try:
            yield entry.tensor
        finally:
            with self._cv:
                entry.pinners[me] -= 1
                if not entry.pinners[me]:
                    del entry.pinners[me]
                entry.dirty = entry.dirty or dirty
                self._wake_pump()

    def put(self, key: str, tensor: torch.Tensor, tier: TierArg | Literal["nvme"] = None) -> None:
        """Store a copy of ``tensor`` under ``key`` at ``tier`` (dirty until written down).

        ``tier=None`` places it in the highest tier it fits, or writes it straight to the store
        when it fits none; ``tier="nvme"`` always writes through to the store. Gets of the key
        wait for a write-through in flight; if it fails the key keeps its old value.
        """
        key = validate_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTensorError(f"put({key!r}) got {type(tensor).__name__}, not a Tensor")
        meta = Meta.of(tensor)
        target = self._put_target(key, meta, tier)
        with self._cv:
            self._check_open()
            self._settle_key(key, allow_pinned=target != NVME)
            self._meta[key] = meta
            self.policy.access(key)
            if target != NVME:
                self._put_in_tier(key, tensor, meta, target)
                self._queue_lookahead(target)
            else:  # reads of the key wait (as for a write-back) until the store has it
                self._writing[key] = WriteBack(Entry(key, meta, HOST, tensor))
        self._drain()
        if target == NVME:
            self._write_through(key, tensor, meta)

    def _write_through(self, key: str, tensor: torch.Tensor, meta: Meta) -> None:
        """Write ``tensor`` to the store (lock not held); on failure forget its metadata."""
        ok = False
        try:
            self.store.put(key, tensor)
            ok = True
        finally:
            with self._cv:
                del self._writing[key]
                if ok:
                    self._count_io("written", meta.nbytes)
                else:  # the store still holds the old value: look its shape up again
                    self._meta.pop(key, None)
                self._wake_pump()

    def prefetch(self, keys: Iterable[str], tier: TierArg = HOST) -> None:
        """Start reading ``keys`` into ``tier`` in the background, in order; returns at once.

        Items that do not fit without evicting something the policy ranks as needed sooner
        wait their turn; items larger than the tier are skipped.
        """
        keys = [validate_key(k) for k in keys]
        for key in keys:
            self._meta_for(key)
        with self._cv:
            self._check_open()
            target = self._tier_for(None if tier is None else tier, None)
            queued = set(self._explicit)
            self._explicit.extend((k, target) for k in keys if (k, target) not in queued)
            self._plan_prefetches()
        self._drain()

    def mark_dirty(self, key: str) -> None:
        """Record that the cached tensor of ``key`` was modified in place."""
        with self._cv:
            entry = self._find(key)
            if entry is None or entry.state not in (READY, FLUSHING):
                raise KeyNotFoundError(
                    f"mark_dirty({key!r}): the item is not cached (evicted?); modify cached "
                    "tensors inside `with cache.pinned(key)` so they stay resident"
                )
            entry.dirty = True

    def evict(self, key: str) -> None:
        """Drop ``key`` from the memory tiers, writing it down first when dirty (blocks)."""
        with self._cv:
            self._check_open()
            while (entry := self._find(key)) is not None:
                if entry.pins:
                    raise PinnedError(f"evict({key!r}): the item is pinned; leave pinned() first")
                if entry.state == READY and not entry.claims:
                    self._evict(entry, demote=False)
                else:
                    self._wait()
            while key in self._writing:
                self._wait()
            self._raise_errors()

    def delete(self, key: str) -> None:
        """Remove ``key`` from the cache and the store (no write-back)."""
        with self._cv:
            self._check_open()
            cached = self._settle_key(key, allow_pinned=False)
            self._drop_queued(key)
            self.policy.forget(key)
            self._meta.pop(key, None)
        try:
            self.store.delete(key)
        except KeyNotFoundError:
            if not cached:
                raise

    def flush(self) -> None:
        """Write every dirty item to the store and wait; items stay cached, now clean.

        After ``flush()`` and ``store.commit()`` the store holds the latest value of every key.
        Do not modify cached tensors while ``flush`` runs.
        """
        with self._cv:
            self._check_open()
            flushing = self._start_flush()
            while self._writing or any(e.state == FLUSHING for e in flushing):
                self._wait()
            self._raise_errors()

    def stats(self) -> CacheStats:
        """A snapshot of hits, misses, bytes used per tier, NVMe bytes and stall time."""
        with self._cv:
            tiers = {
                name: TierStats(t.hits, t.misses, t.used, t.budget, t.bytes_in, t.bytes_out)
                for name, t in self._tiers.items()
            }
            c = self._counters
            return CacheStats(
                tiers[DEVICE],
                tiers[HOST],
                c["bytes_read"],
                c["bytes_written"],
                c["reads"],
                c["writes"],
                self._stall,
            )

    def where(self, key: str) -> str | None:
        """``"device"``, ``"host"`` (resident or being read in), or ``None``."""
        with self._cv:
            entry = self._find(key)
            return entry.tier if entry is not None else None

    def close(self) -> None:
        """Flush, wait for reads in flight, stop the pump thread and drop all buffers.

        The store stays open (it belongs to the caller).
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cv:
                while any(t.unsettled() for t in self._tiers.values()) or self._writing:
                    self._wait()
                self._closed = True
                for t in self._tiers.values():
                    t.entries.clear()
                    t.earmarks.clear()
                    t.used = 0
                self._cv.notify_all()
            self._pump.join()

    def __enter__(self) -> TierCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        with self._cv:
            if isinstance(key, str) and (self._find(key) is not None or key in self._writing):
                return True
        return key in self.store

    def __repr__(self) -> str:
        dev, host = self._tiers[DEVICE], self._tiers[HOST]
        return (
            f"TierCache(device={self.device}, device_budget={format_size(dev.budget)}, "
            f"host_budget={format_size(host.budget)}, policy={self.policy!r})"
        )

    # ------------------------------------------------------------- asyncio API
    async def aget(self, key: str, tier: TierArg = None) -> torch.Tensor:
        """:meth:`get` for asyncio: the wait happens in a worker thread, not the event loop."""
        return await asyncio.to_thread(self.get, key, tier)

    async def aput(
        self, key: str, tensor: torch.Tensor, tier: TierArg | Literal["nvme"] = None
    ) -> None:
        """:meth:`put` for asyncio (the copy and any write run in a worker thread)."""
        await asyncio.to_thread(self.put, key, tensor, tier)

    async def aprefetch(self, keys: Iterable[str], tier: TierArg = HOST) -> None:
        """:meth:`prefetch` for asyncio."""
        await asyncio.to_thread(self.prefetch, list(keys), tier)

    # ------------------------------------------------------- get / pinned path
    @contextlib.contextmanager
    def _claimed(self, key: str, tier: TierArg) -> Iterator[Entry]:
        """The ready entry of ``key`` at ``tier``, held (not evictable) for the block."""
        key = validate_key(key)
        meta = self._meta_for(key)
        with self._cv:
            self._check_open()
            target = self._tier_for(tier, meta, key)
            self._count_lookup(key, target)
            self.policy.access(key)
            entry = self._acquire(key, target)
            entry.claims += 1
            self._queue_lookahead(target)
        self._drain()
        try:
            yield entry
        finally:
            with self._cv:
                entry.claims -= 1
                self._wake_pump()

    def _acquire(self, key: str, target: TierName) -> Entry:
        """Wait until ``key`` is ready at ``target``; start the read or move it there."""
        waited: Entry | None = None
        owned: Entry | None = None  # a read this call started; claimed until it is ready
        try:
            while True:
                self._raise_errors()
                entry = self._find(key)
                if entry is None and waited is not None and waited.state == FAILED:
                    raise waited.error  # type: ignore[misc]
                if entry is not None and entry is owned and entry.state == READY:
                    entry.claims -= 1
                    owned = None
                if entry is None:
                    owned = waited = self._start_load(key, target)
                elif entry.state == LOADING:
                    if owned is None:  # hold it: once read, nobody may evict it before we return
                        owned = entry
                        entry.claims += 1
                    waited = entry
                    self._wait()
                elif entry.tier == target:
                    return entry
                elif entry.pins:
                    self._wait_for_unpin(entry, target)
                elif entry.state == READY and not entry.claims:
                    self._move(entry, target, prefetch=False)
                else:
                    self._wait()
        finally:
            if owned is not None:
                owned.claims -= 1

    def _wait_for_unpin(self, entry: Entry, target: TierName) -> None:
        """One wait for other threads to unpin ``entry``; raise if only blocked ones pin it."""
        me = threading.get_ident()
        if not set(entry.pinners) - self._blocked - {me}:
            raise PinnedError(
                f"{entry.key!r} is pinned in the {entry.tier} tier; it cannot move to {target} "
                "until unpinned"
            )
        self._blocked.add(me)
        try:
            self._wait(0.05)
        finally:
            self._blocked.discard(me)

    def _start_load(self, key: str, target: TierName) -> Entry | None:
        """Reserve bytes and queue a read of ``key`` from the store (a demand miss).

        Returns the new entry, claimed once for the caller, or ``None`` after a wait.
        """
        if key in self._writing:
            self._wait()
            return None
        self._drop_queued(key)
        meta = self._meta[key]
        host = self._tiers[HOST]
        tier: TierName = HOST if meta.footprint <= host.budget else target
        if not self._reserve(tier, meta.footprint, key, prefetch=False, wait=True):
            return None  # the lock was released while waiting; the caller looks again
        entry = self._new_loading(key, meta, tier)
        entry.claims += 1
        return entry

    def _new_loading(self, key: str, meta: Meta, tier: TierName) -> Entry:
        t = self._tiers[tier]
        entry = Entry(key, meta, tier, t.allocate(meta, self.device), state=LOADING)
        t.entries[key] = entry
        self._launches.append(lambda: self._launch_load(entry))
        return entry

    def _move(self, entry: Entry, target: TierName, *, prefetch: bool) -> bool:
        """Move a ready entry to ``target`` (a host<->device copy, no disk I/O).

        Returns ``False`` when there is no room yet; a demand move then waits for room without
        holding the entry (two moves in opposite directions must not wait on each other).
        """
        entry.claims += 1  # demoting victims into our tier must not evict the entry itself
        try:
            ok = self._reserve(target, entry.size, entry.key, prefetch=prefetch)
        finally:
            entry.claims -= 1
        if ok:
            self._relocate(entry, target)
        elif not prefetch:
            self._wait_for_room(self._tiers[target], entry.size, entry.key)
        return ok

    def _relocate(self, entry: Entry, target: TierName) -> None:
        src, dst = self._tiers[entry.tier], self._tiers[target]
        buf = dst.allocate(entry.meta, self.device)
        buf.copy_(entry.tensor)
        del src.entries[entry.key]
        src.used -= entry.size
        src.bytes_out += entry.meta.nbytes
        dst.bytes_in += entry.meta.nbytes
        entry.tier, entry.tensor = target, buf
        dst.entries[entry.key] = entry
        self._cv.notify_all()

    # ------------------------------------------------------------- put path
    def _put_target(self, key: str, meta: Meta, tier: str | None) -> TierName | Literal["nvme"]:
        if tier == NVME:
            return NVME
        if tier is None:
            fits = [n for n in TIERS if 0 < meta.footprint <= self._tiers[n].budget]
            return fits[0] if fits else NVME
        return self._tier_for(tier, meta, key)

    def _put_in_tier(self, key: str, tensor: torch.Tensor, meta: Meta, target: TierName) -> None:
        while True:
            self._raise_errors()
            entry = self._find(key)
            if entry is not None and entry.tier == target and entry.meta == meta:
                entry.tensor.copy_(tensor)  # same shape: update in place, pinned or not
                entry.dirty = True
                return
            if entry is not None and entry.pins:
                raise PinnedError(f"{key!r} is pinned with another shape or tier; unpin first")
            if entry is not None:
                self._discard(entry)
            if not self._reserve(target, meta.footprint, key, prefetch=False, wait=True):
                self._settle_key(key, allow_pinned=True)
                continue
            t = self._tiers[target]
            buf = t.allocate(meta, self.device)
            buf.copy_(tensor)
            t.entries[key] = Entry(key, meta, target, buf, dirty=True)
            return

    def _settle_key(self, key: str, *, allow_pinned: bool) -> bool:
        """Wait until ``key`` has no I/O in flight; without ``allow_pinned`` drop its entry.

        Returns whether the key was cached.
        """
        cached = False
        while True:
            entry = self._find(key)
            if entry is not None and entry.pins and not allow_pinned:
                raise PinnedError(f"{key!r} is pinned; leave pinned() before replacing it")
            if entry is not None and (entry.state != READY or entry.claims):
                self._wait()
            elif key in self._writing:
                cached = True
                self._wait()
            else:
                break
        if entry is not None:
            cached = True
            if not allow_pinned:
                self._discard(entry)
        return cached
