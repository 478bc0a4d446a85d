"""The three-tier cache: device memory, page-aligned host memory, and the store on NVMe.

The public API and the get/put paths live here, over private parts that each own their state:
:class:`~tierswap.cache._tiers.Tier` (a tier's ledger and the entries and write-backs its bytes
are held for), :class:`~tierswap.cache._core.CacheCore` (which item is where, room, eviction,
moves and I/O), :class:`~tierswap.cache._prefetch.Prefetcher` (the prefetch queues) and
:class:`~tierswap.cache._gate.Gate` (the one lock, store calls outside it, the pump)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Literal

import torch

from tierswap._lifetime import close_at_exit
from tierswap.cache._core import CacheCore, CacheStore
from tierswap.cache._gate import Gate
from tierswap.cache._prefetch import Prefetcher
from tierswap.cache._tiers import FAILED, FLUSHING, LOADING, READY, TIERS, Entry, Meta, Tier
from tierswap.config import format_size, parse_size
from tierswap.engine import CacheStats, EvictionPolicy, make_policy, transfers_for
from tierswap.errors import (
    InvalidTensorError,
    KeyNotFoundError,
    PinnedError,
)
from tierswap.keys import validate_key
from tierswap.tiers import DEVICE, HOST, NVME, TierName

__all__ = ["TierCache"]


TierArg = Literal["device", "host"] | None


class TierCache:
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
    Every item lives in at most one memory tier (the tiers are exclusive) and, once written down,
    in the store. Budgets count whole 4 KiB pages and are hard limits (an engine
    :class:`~tierswap.engine.Ledger` per tier): bytes being read in and dirty bytes being written
    down count until their I/O ends. An item larger than a tier's budget skips that tier when the
    cache places it (``tier=None``, prefetches, demotions); naming that tier raises
    :class:`~tierswap.errors.BudgetError`. A tensor returned by ``get`` stays valid until the
    item is evicted; to modify it in place, hold it with :meth:`pinned`, then :meth:`mark_dirty`.

    Thread safety: every method may be called from many threads at once. One lock (the
    :class:`~tierswap.cache._gate.Gate`'s) guards all state and no call holds it twice, so a wait
    releases it whole. Store calls that start I/O or look up metadata run outside it (by the
    calling thread on its way out, or the pump thread), as do the I/O itself and the body of a
    ``with pinned(...)`` block. I/O completions take the lock only to update state and wake
    waiters; the pump then plans the prefetches the freed bytes allow."""

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
        self.store = store
        self.device = torch.device(device if device is not None else default)
        self._gate = Gate()
        self._cv = self._gate.cv
        self._tiers: dict[TierName, Tier] = {
            DEVICE: Tier(
                DEVICE, parse_size(device_budget, name="device_budget"), self._cv, self.device
            ),
            HOST: Tier(
                HOST, parse_size(host_budget, name="host_budget"), self._cv, torch.device("cpu")
            ),
        }
        self.policy = make_policy(policy)
        self._prefetch = Prefetcher()
        self._core = CacheCore(
            store, self.policy, self._tiers, self._gate, self._prefetch.queued,
            transfers=transfers_for(self.device),
        )  # fmt: skip
        self._gate.start(self._plan)
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
                self._gate.wake()

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
            self._gate.check_open()
            # a write-through takes the cached entry over (begin_write_through)
            self._settle_key(key, allow_pinned=target != NVME, drop=False)
            self.policy.access(key)
            if target != NVME:
                self._put_in_tier(key, tensor, meta, target)
            else:
                self._core.begin_write_through(key, meta, tensor)
            # only now: a put that raised above (pins, a failed write-back it waited for)
            # leaves the shape that reads of the key from the store expect
            self._core.meta[key] = meta
            if target != NVME:
                self._read_ahead(target)
        self._gate.drain()
        if target == NVME:
            self._write_through(key, tensor)

    def _write_through(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` to the store (lock not held); on failure the key keeps its value. After
        a failure the shape of the value the store still holds is looked up again (here, outside the
        lock), so gets that waited for the write read that value."""
        ok = False
        try:
            self._core.disk.put(key, tensor)
            ok = True
        finally:
            stored = None if ok else self._core.stored_meta(key)
            with self._cv:
                self._core.end_write_through(key, ok=ok, stored=stored)

    def prefetch(self, keys: Iterable[str], tier: TierArg = HOST) -> None:
        """Start reading ``keys`` into ``tier`` in the background, in order; returns at once.

        Items that do not fit without evicting something the policy ranks as needed sooner
        wait their turn; items larger than the tier are skipped.
        """
        keys = [validate_key(k) for k in keys]
        for key in keys:
            self._core.meta_for(key)
        with self._cv:
            self._gate.check_open()
            self._prefetch.add(keys, self._core.tier_for(tier, None))
            self._plan()
        self._gate.drain()

    def mark_dirty(self, key: str) -> None:
        """Record that the cached tensor of ``key`` was modified in place."""
        with self._cv:
            entry = self._core.find(key)
            if entry is None or entry.state not in (READY, FLUSHING):
                raise KeyNotFoundError(
                    f"mark_dirty({key!r}): the item is not cached (evicted?); modify cached "
                    "tensors inside `with cache.pinned(key)` so they stay resident"
                )
            entry.dirty = True

    def evict(self, key: str) -> None:
        """Drop ``key`` from the memory tiers, writing it down first when dirty (blocks)."""
        with self._cv:
            self._gate.check_open()
            while (entry := self._core.find(key)) is not None:
                if entry.pins:
                    raise PinnedError(f"evict({key!r}): the item is pinned; leave pinned() first")
                if entry.state == READY and not entry.claims:
                    self._core.evict(entry, demote=False)
                else:
                    self._gate.wait()
            while key in self._core.write_backs:
                self._gate.wait()
            self._core.raise_errors()

    def delete(self, key: str) -> None:
        """Remove ``key`` from the cache and the store (no write-back)."""
        with self._cv:
            self._gate.check_open()
            cached = self._settle_key(key, allow_pinned=False)
            self._prefetch.drop(key)
            self._core.release_unwanted(self._prefetch.queued())  # room set aside for its read
            self.policy.forget(key)
            self._core.meta.pop(key, None)
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
            self._gate.check_open()
            while self._core.dirty_moving():  # a move's copy lands before its value is written
                self._gate.wait()
            flushing = self._core.start_flush()
            while self._core.write_backs or any(e.state == FLUSHING for e in flushing):
                self._gate.wait()
            self._core.raise_errors()

    def stats(self) -> CacheStats:
        """A snapshot of hits, misses, bytes used per tier (the tiers' ledgers), NVMe bytes and
        stall time."""
        with self._cv:
            return CacheStats.of(
                self._tiers[DEVICE].ledger, self._tiers[HOST].ledger,
                self._core.disk.traffic(), self._gate.stall_seconds,
            )  # fmt: skip

    def where(self, key: str) -> str | None:
        """``"device"``, ``"host"`` (resident or being read in), or ``None``."""
        with self._cv:
            entry = self._core.find(key)
            return entry.tier if entry is not None else None

    def close(self) -> None:
        """Flush, wait for reads in flight, stop the pump thread and drop all buffers.

        The store stays open (it belongs to the caller).
        """
        if self._gate.closed:
            return
        try:
            self.flush()
        finally:
            with self._cv:
                while any(t.unsettled() for t in self._tiers.values()) or self._core.write_backs:
                    self._gate.wait()
                self._gate.close()
                for t in self._tiers.values():
                    t.clear()
            self._gate.join()

    def __enter__(self) -> TierCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        with self._cv:
            if isinstance(key, str) and (
                self._core.find(key) is not None or key in self._core.write_backs
            ):
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
    def _plan(self) -> None:
        """Start the prefetches the queues allow now (lock held; never waits)."""
        self._prefetch.plan(self._core)

    def _read_ahead(self, tier: TierName) -> None:
        """After an access: read ahead what the policy expects next, into ``tier``."""
        self._prefetch.follow(self.policy.upcoming(), tier)
        self._plan()

    @contextlib.contextmanager
    def _claimed(self, key: str, tier: TierArg) -> Iterator[Entry]:
        """The ready entry of ``key`` at ``tier``, held (not evictable) for the block."""
        key = validate_key(key)
        meta = self._core.meta_for(key)
        with self._cv:
            self._gate.check_open()
            target = self._core.tier_for(tier, meta, key)
            self._core.count_lookup(key, target)
            self.policy.access(key)
            entry = self._acquire(key, target)
            entry.claims += 1
            self._read_ahead(target)
        self._gate.drain()
        try:
            yield entry
        finally:
            with self._cv:
                entry.claims -= 1
                self._gate.wake()

    def _acquire(self, key: str, target: TierName) -> Entry:
        """Wait until ``key`` is ready at ``target``; start the read or move it there."""
        waited: Entry | None = None
        owned: Entry | None = None  # a read this call started; claimed until it is ready
        try:
            while True:
                self._core.raise_errors()
                entry = self._core.find(key)
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
                    self._gate.wait()
                elif entry.tier == target:
                    return entry
                else:
                    self._move_to(entry, target)
        finally:
            if owned is not None:
                owned.claims -= 1

    def _move_to(self, entry: Entry, target: TierName) -> None:
        """One step of moving a ready entry to ``target``: the move, or a wait for it."""
        if entry.pins:
            self._wait_for_unpin(entry, target)
        elif entry.state == READY and not entry.claims:
            self._core.move(entry, target, prefetch=False)
        else:
            self._gate.wait()

    def _wait_for_unpin(self, entry: Entry, target: TierName) -> None:
        """One wait for other threads to unpin ``entry``; raise if only blocked ones pin it."""
        if not set(entry.pinners) - self._core.blocked - {threading.get_ident()}:
            raise PinnedError(
                f"{entry.key!r} is pinned in the {entry.tier} tier; it cannot move to {target} "
                "until unpinned"
            )
        with self._core.blocked_on():
            self._gate.wait(0.05)

    def _start_load(self, key: str, target: TierName) -> Entry | None:
        """Reserve bytes and queue a read of ``key`` from the store (a demand miss). Returns the new
        entry, claimed once for the caller, or ``None`` after a wait."""
        if key in self._core.write_backs:
            self._gate.wait()
            return None
        self._prefetch.drop(key)
        meta = self._core.meta.get(key)
        if meta is None:  # deleted, or written through and failed, while the caller waited
            raise KeyNotFoundError(f"key {key!r} is not in the cache or its store")
        tier: TierName = HOST if meta.footprint <= self._tiers[HOST].budget else target
        if not self._core.reserve(tier, meta.footprint, key, prefetch=False, wait=True):
            return None  # the lock was released while waiting; the caller looks again
        entry = self._core.new_loading(key, meta, tier)
        entry.claims += 1
        return entry

    # ------------------------------------------------------------- put path
    def _put_target(self, key: str, meta: Meta, tier: str | None) -> TierName | Literal["nvme"]:
        if tier == NVME:
            return NVME
        if tier is None:
            fits = [n for n in TIERS if 0 < meta.footprint <= self._tiers[n].budget]
            return fits[0] if fits else NVME
        return self._core.tier_for(tier, meta, key)

    def _put_in_tier(self, key: str, tensor: torch.Tensor, meta: Meta, target: TierName) -> None:
        """Place a copy of ``tensor`` in ``target`` (lock held; may wait for room). A cached value
        of ``key`` that cannot be updated in place is dropped only when the put cannot fail any
        more, or the store has it: a dirty one whose room is needed is written down first, as an
        eviction would, so that a put which then raises (a failed write-back reported here, pins)
        leaves the key its value."""
        while True:
            self._core.raise_errors()
            entry = self._core.find(key)
            if entry is not None and entry.tier == target and entry.meta == meta:
                # same shape: update in place, pinned or not
                from_device = tensor.device.type != "cpu"
                self._core.start_copy(
                    entry.tensor, target, tensor, from_device=from_device
                ).result()
                entry.dirty = True
                return
            if entry is not None and entry.pins:
                raise PinnedError(f"{key!r} is pinned with another shape or tier; unpin first")
            if entry is not None and entry.dirty and not self._fits_instead(entry, meta, target):
                self._core.evict(entry, demote=False)
                self._settle_key(key, allow_pinned=True)  # wait for the write
                continue
            if entry is not None:
                self._core.discard(entry)
            if self._core.reserve(target, meta.footprint, key, prefetch=False, wait=True):
                self._core.add_copy(key, tensor, meta, target)
                return
            self._settle_key(key, allow_pinned=True)

    def _fits_instead(self, entry: Entry, meta: Meta, target: TierName) -> bool:
        """Whether an item of ``meta`` fits in ``target`` now, in place of ``entry``."""
        freed = entry.size if entry.tier == target else 0
        return self._tiers[target].room(entry.key) + freed >= meta.footprint

    def _settle_key(self, key: str, *, allow_pinned: bool, drop: bool = True) -> bool:
        """Wait until ``key`` has no I/O in flight; without ``allow_pinned`` drop its entry (unless
        ``drop`` is false: the caller takes it over). Returns whether the key was cached."""
        cached = False
        while True:
            entry = self._core.find(key)
            if entry is not None and entry.pins and not allow_pinned:
                raise PinnedError(f"{key!r} is pinned; leave pinned() before replacing it")
            if entry is not None and (entry.state != READY or entry.claims):
                self._gate.wait()
            elif key in self._core.write_backs:
                cached = True
                self._gate.wait()
            else:
                break
        if entry is not None:
            cached = True
            if not allow_pinned and drop:
                self._core.discard(entry)
        return cached
