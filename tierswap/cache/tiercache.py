"""The three-tier cache: device memory, page-aligned host memory, and the store on NVMe.

Every item lives in at most one memory tier at a time (the tiers are exclusive) and, once written
down, in the store. Budgets count whole 4 KiB pages and are hard limits: bytes being read in and
dirty bytes being written down count until the I/O finishes.

Locking: one lock guards all state. Store calls that start I/O (``get_async``/``put_async``)
are never made while holding it; they are queued as *launches* and run right after the lock is
released, by the calling thread or by the cache's pump thread. I/O completion callbacks only
update state under the lock and wake waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from tierswap.cache._tiers import (
    FAILED,
    FLUSHING,
    LOADING,
    READY,
    TIERS,
    Entry,
    Meta,
    Tier,
    TierName,
    WriteBack,
)
from tierswap.cache.policies import EvictionPolicy, make_policy
from tierswap.cache.stats import CacheStats, TierStats
from tierswap.config import format_size, parse_size
from tierswap.errors import (
    BudgetError,
    ConfigError,
    InvalidTensorError,
    KeyNotFoundError,
    PinnedError,
    StoreClosedError,
)
from tierswap.keys import validate_key

__all__ = ["TierCache"]

TierArg = Literal["device", "host"] | None
_DONE, _PENDING, _BLOCKED = "done", "pending", "blocked"  # outcomes of one prefetch attempt


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
        ``"lru"``, ``"lookahead"`` or an :class:`~tierswap.cache.policies.EvictionPolicy`.

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
        store: Any,
        *,
        device_budget: int | str,
        host_budget: int | str,
        device: str | torch.device | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        self.store = store
        self.policy = make_policy(policy)
        default = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device if device is not None else default)
        self._tiers: dict[TierName, Tier] = {
            "device": Tier("device", parse_size(device_budget, name="device_budget")),
            "host": Tier("host", parse_size(host_budget, name="host_budget")),
        }
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._meta: dict[str, Meta] = {}
        self._meta_wanted: set[str] = set()
        self._writing: dict[str, WriteBack] = {}
        self._launches: list[Callable[[], None]] = []
        self._explicit: list[tuple[str, TierName]] = []
        self._auto: list[tuple[str, TierName]] = []
        self._auto_iter: Iterator[tuple[str, TierName]] | None = None
        self._errors: list[BaseException] = []
        self._blocked: set[int] = set()  # threads waiting for room (pin deadlock detection)
        self._counters = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}
        self._stall = 0.0
        self._pump_wanted = False
        self._closed = False
        self._pump = threading.Thread(target=self._pump_loop, name="tierswap-cache", daemon=True)
        self._pump.start()

    # ----------------------------------------------------------------- public API
    def get(self, key: str, tier: TierArg = None) -> torch.Tensor:
        """The item's tensor at ``tier``, read or moved there first when needed (blocks).

        ``tier=None`` picks the device tier when it is on and the item fits, else host. At the host
        tier the cached buffer itself is returned (no copy).
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
        when it fits none; ``tier="nvme"`` always writes through to the store.
        """
        key = validate_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTensorError(f"put({key!r}) got {type(tensor).__name__}, not a Tensor")
        meta = Meta.of(tensor)
        target = self._put_target(key, meta, tier)
        with self._cv:
            self._check_open()
            self._settle_key(key, allow_pinned=target != "nvme")
            self._meta[key] = meta
            self.policy.access(key)
            if target != "nvme":
                self._put_in_tier(key, tensor, meta, target)
                self._queue_lookahead(target)
        self._drain()
        if target == "nvme":
            self.store.put(key, tensor)
            with self._cv:
                self._count_io("written", meta.nbytes)

    def prefetch(self, keys: Iterable[str], tier: TierArg = "host") -> None:
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
            self._explicit = [item for item in self._explicit if item[0] != key]
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
                name: TierStats(t.hits, t.misses, t.used, t.budget)
                for name, t in self._tiers.items()
            }
            c = self._counters
            return CacheStats(
                tiers["device"],
                tiers["host"],
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
        dev, host = self._tiers["device"], self._tiers["host"]
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

    async def aprefetch(self, keys: Iterable[str], tier: TierArg = "host") -> None:
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
                    raise PinnedError(
                        f"{key!r} is pinned in the {entry.tier} tier; it cannot move to {target}"
                    )
                elif entry.state == READY and not entry.claims:
                    self._move(entry, target, prefetch=False)
                else:
                    self._wait()
        finally:
            if owned is not None:
                owned.claims -= 1

    def _start_load(self, key: str, target: TierName) -> Entry | None:
        """Reserve bytes and queue a read of ``key`` from the store (a demand miss).

        Returns the new entry, claimed once for the caller, or ``None`` after a wait.
        """
        if key in self._writing:
            self._wait()
            return None
        self._drop_queued(key)
        meta = self._meta[key]
        host = self._tiers["host"]
        tier: TierName = "host" if meta.footprint <= host.budget else target
        if not self._reserve(tier, meta.footprint, incoming=None, wait=True):
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
            ok = self._reserve(target, entry.size, incoming=entry.key if prefetch else None)
        finally:
            entry.claims -= 1
        if ok:
            self._relocate(entry, target)
        elif not prefetch:
            self._wait_for_room(self._tiers[target], entry.size)
        return ok

    def _relocate(self, entry: Entry, target: TierName) -> None:
        src, dst = self._tiers[entry.tier], self._tiers[target]
        buf = dst.allocate(entry.meta, self.device)
        buf.copy_(entry.tensor)
        del src.entries[entry.key]
        src.used -= entry.size
        entry.tier, entry.tensor = target, buf
        dst.entries[entry.key] = entry
        self._cv.notify_all()

    # ------------------------------------------------------------- put path
    def _put_target(self, key: str, meta: Meta, tier: str | None) -> TierName | Literal["nvme"]:
        if tier == "nvme":
            return "nvme"
        if tier is None:
            fits = [n for n in TIERS if 0 < meta.footprint <= self._tiers[n].budget]
            return fits[0] if fits else "nvme"
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
            if not self._reserve(target, meta.footprint, incoming=None, wait=True):
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

    def _discard(self, entry: Entry) -> None:
        t = self._tiers[entry.tier]
        del t.entries[entry.key]
        t.used -= entry.size
        self._cv.notify_all()

    # ---------------------------------------------------- budgets and eviction
    def _reserve(
        self, tier: TierName, size: int, *, incoming: str | None, wait: bool = False
    ) -> bool:
        """Count ``size`` bytes as used in ``tier``, evicting as the policy says.

        ``incoming`` names the key of a prefetch: the policy may then refuse to evict (do no
        harm). Returns ``False`` when the bytes are not free yet, after one wait for them with
        ``wait=True`` (the lock was released: the caller must look at the state again).
        """
        t = self._tiers[tier]
        if size > t.budget:
            raise BudgetError(f"{format_size(size)} cannot fit the {tier} budget")
        if incoming is not None and t.demand_waiting:
            return False  # a blocked get/put goes first: prefetches must not take its bytes
        while t.free < size:
            victim = None
            if t.free + t.writing < size:
                if incoming is None:
                    victim = t.victim(self.policy)
                else:
                    victim = t.victim(self.policy, incoming, strict=True)
            if victim is not None:
                self._evict(victim, demote=True)
                continue
            if wait:
                self._wait_for_room(t, size)
            return False
        t.used += size
        return True

    def _wait_for_room(self, t: Tier, size: int) -> None:
        """One wait for bytes to free up in ``t``; prefetches stand back meanwhile."""
        timeout = self._check_pins(t, size)
        me = threading.get_ident()
        t.demand_waiting += 1
        self._blocked.add(me)
        try:
            self._wait(timeout)
        finally:
            t.demand_waiting -= 1
            self._blocked.discard(me)

    def _check_pins(self, t: Tier, size: int) -> float | None:
        """Raise when waiting for room could never end; else how long to wait (None: a wake).

        Pins held by other threads that are not themselves blocked here will be released, so
        the caller waits for them (polling: unpinning is not an event it can miss safely).
        """
        pinned = t.pinned_bytes()
        if pinned + size <= t.budget and (t.unsettled() or self._launches):
            return None
        others = t.pin_holders() - self._blocked - {threading.get_ident()}
        if others:
            return 0.05
        raise BudgetError(
            f"the {t.name} tier cannot hold {format_size(size)} more: "
            f"{format_size(pinned)} of its {format_size(t.budget)} budget is pinned; "
            f"pin fewer items at once or raise {t.name}_budget"
        )

    def _evict(self, entry: Entry, *, demote: bool) -> None:
        """Take a ready, unheld entry out of its tier: demote, write back, or drop."""
        if demote and entry.tier == "device" and self._demote(entry):
            return
        t = self._tiers[entry.tier]
        del t.entries[entry.key]
        if not entry.dirty:
            t.used -= entry.size
            self._cv.notify_all()
            return
        wb = WriteBack(entry)
        self._writing[entry.key] = wb
        t.writing += entry.size
        self._launches.append(lambda: self._launch_write(wb))

    def _demote(self, entry: Entry) -> bool:
        """Move a device victim to host if host has room, evicting only clean, later items."""
        host = self._tiers["host"]
        if entry.size > host.budget:
            return False
        while host.free < entry.size:
            victim = host.victim(self.policy, entry.key, clean_only=True)
            if victim is None:
                return False
            self._evict(victim, demote=False)
        host.used += entry.size
        self._relocate(entry, "host")
        return True

    # --------------------------------------------------------------- prefetch
    def _queue_lookahead(self, tier: TierName) -> None:
        upcoming = self.policy.upcoming()
        self._auto = []
        self._auto_iter = ((k, tier) for k in upcoming)
        self._plan_prefetches()

    def _plan_prefetches(self) -> None:
        """Start what the prefetch queues allow now (under the lock; never waits)."""
        self._explicit = self._run_queue(self._explicit, None)
        budget = self._tiers["host"].budget + self._tiers["device"].budget
        self._auto = self._run_queue(self._auto, self._auto_iter, budget)

    def _run_queue(
        self,
        queue: list[tuple[str, TierName]],
        more: Iterator[tuple[str, TierName]] | None,
        budget: int = 0,
    ) -> list[tuple[str, TierName]]:
        kept: list[tuple[str, TierName]] = []
        seen = 0
        items = itertools.chain(queue, more) if more is not None else iter(queue)
        for item in items:
            outcome = self._try_prefetch(*item)
            if outcome != _DONE:
                kept.append(item)
            if outcome == _BLOCKED:
                kept.extend(itertools.islice(items, len(queue)))  # keep the queued rest
                break
            meta = self._meta.get(item[0])
            seen += meta.footprint if meta else 0
            if more is not None and seen > budget:
                break
        return kept

    def _try_prefetch(self, key: str, tier: TierName) -> str:
        entry = self._find(key)
        meta = self._meta.get(key)
        if meta is None:
            self._want_meta(key)
            return _BLOCKED
        if meta.footprint > self._tiers[tier].budget:
            return _DONE  # too large for the tier: it skips the tier, so skip it here
        if entry is not None:
            if entry.tier in (tier, "device"):
                return _DONE
            if entry.state == LOADING:
                return _PENDING
            if entry.pins or entry.state != READY:
                return _DONE
            self.policy.admit(key)
            ok = self._move(entry, tier, prefetch=True)
            return _DONE if ok else _BLOCKED
        if key in self._writing:
            return _BLOCKED
        load_tier: TierName = "host" if meta.footprint <= self._tiers["host"].budget else tier
        self.policy.admit(key)
        if not self._reserve(load_tier, meta.footprint, incoming=key):
            return _BLOCKED
        self._new_loading(key, meta, load_tier)
        return _DONE if load_tier == tier else _PENDING

    def _want_meta(self, key: str) -> None:
        """Look ``key`` up in the store outside the lock, then plan prefetches again."""
        if key in self._meta_wanted:
            return
        self._meta_wanted.add(key)

        def lookup() -> None:
            try:
                info = self.store.info(key)
                meta = Meta(info.dtype, tuple(info.shape), info.nbytes)
            except Exception:  # a scheduled key the store lacks: never prefetch it
                meta = None
            with self._cv:
                self._meta_wanted.discard(key)
                if meta is None:
                    self._drop_queued(key)
                else:
                    self._meta.setdefault(key, meta)
                self._wake_pump()

        self._launches.append(lookup)

    def _drop_queued(self, key: str) -> None:
        self._explicit = [item for item in self._explicit if item[0] != key]
        self._auto = [item for item in self._auto if item[0] != key]

    # ------------------------------------------------------------- flushing
    def _start_flush(self) -> list[Entry]:
        flushing = []
        for t in self._tiers.values():
            for entry in t.entries.values():
                if entry.dirty and entry.state == READY:
                    entry.dirty, entry.state = False, FLUSHING
                    flushing.append(entry)
                    self._launches.append(lambda e=entry: self._launch_flush(e))
        return flushing

    # ------------------------------------------------- I/O launch and completion
    def _launch_load(self, entry: Entry) -> None:
        on_cpu = entry.tensor.device.type == "cpu"
        try:
            future = self.store.get_async(entry.key, out=entry.tensor if on_cpu else None)
        except BaseException as exc:
            self._loaded(entry, None, exc)
            return
        future.add_done_callback(lambda f: self._loaded(entry, f, None))

    def _loaded(self, entry: Entry, future: Any, error: BaseException | None) -> None:
        try:
            if future is not None:
                result = future.result()
                if entry.tensor.device.type != "cpu":
                    entry.tensor.copy_(result)
        except BaseException as exc:
            error = exc
        with self._cv:
            if error is None:
                entry.state = READY
                self._count_io("read", entry.meta.nbytes)
            else:
                entry.state, entry.error = FAILED, error
                self._discard(entry)
            self._wake_pump()

    def _launch_write(self, wb: WriteBack) -> None:
        try:
            future = self.store.put_async(wb.entry.key, wb.entry.tensor)
        except BaseException as exc:
            self._written(wb, None, exc)
            return
        future.add_done_callback(lambda f: self._written(wb, f, None))

    def _written(self, wb: WriteBack, future: Any, error: BaseException | None) -> None:
        error = self._result_error(future, error)
        entry = wb.entry
        with self._cv:
            t = self._tiers[entry.tier]
            del self._writing[entry.key]
            t.writing -= entry.size
            if error is None:
                t.used -= entry.size
                self._count_io("written", entry.meta.nbytes)
            else:  # keep the data: back in its tier, still dirty, and report at the next call
                t.entries[entry.key] = entry
                self._errors.append(error)
            self._wake_pump()

    def _launch_flush(self, entry: Entry) -> None:
        try:
            future = self.store.put_async(entry.key, entry.tensor)
        except BaseException as exc:
            self._flushed(entry, None, exc)
            return
        future.add_done_callback(lambda f: self._flushed(entry, f, None))

    def _flushed(self, entry: Entry, future: Any, error: BaseException | None) -> None:
        error = self._result_error(future, error)
        with self._cv:
            entry.state = READY
            if error is None:
                self._count_io("written", entry.meta.nbytes)
            else:
                entry.dirty = True
                self._errors.append(error)
            self._wake_pump()

    @staticmethod
    def _result_error(future: Any, error: BaseException | None) -> BaseException | None:
        if future is None:
            return error
        try:
            future.result()
        except BaseException as exc:
            return exc
        return None

    # -------------------------------------------------------------- plumbing
    def _wait(self, timeout: float | None = None) -> None:
        """Under the lock: run queued launches (lock released), or wait for a state change."""
        if self._launches:
            self._run_launches()
            return
        start = time.perf_counter()
        self._cv.wait(timeout)
        if threading.current_thread() is not self._pump:
            self._stall += time.perf_counter() - start

    def _run_launches(self) -> None:
        launches, self._launches = self._launches, []
        self._lock.release()
        try:
            for launch in launches:
                launch()
        finally:
            self._lock.acquire()

    def _drain(self) -> None:
        """Outside the lock: run launches queued by the call that just released it."""
        with self._cv:
            if self._launches:
                self._run_launches()

    def _wake_pump(self) -> None:
        self._pump_wanted = True
        self._cv.notify_all()

    def _pump_loop(self) -> None:
        with self._cv:
            while not self._closed:
                if self._pump_wanted:
                    self._pump_wanted = False
                    self._plan_prefetches()
                    self._run_launches()
                else:
                    self._cv.wait()

    def _find(self, key: str) -> Entry | None:
        for t in self._tiers.values():
            entry = t.entries.get(key)
            if entry is not None:
                return entry
        return None

    def _meta_for(self, key: str) -> Meta:
        with self._cv:
            meta = self._meta.get(key)
        if meta is not None:
            return meta
        info = self.store.info(key)  # KeyNotFoundError when the store lacks it
        meta = Meta(info.dtype, tuple(info.shape), info.nbytes)
        with self._cv:
            return self._meta.setdefault(key, meta)

    def _tier_for(self, tier: str | None, meta: Meta | None, key: str = "") -> TierName:
        if tier is not None and tier not in TIERS:
            raise ConfigError(f"tier={tier!r} must be 'device', 'host' or None")
        size = meta.footprint if meta is not None else 0
        if tier is None:
            fits = [n for n in TIERS if self._tiers[n].enabled and size <= self._tiers[n].budget]
            if not fits:
                raise BudgetError(
                    f"{key!r} ({format_size(size)}) fits neither the device nor the host budget; "
                    "raise host_budget or read it with store.get()"
                )
            return fits[0]
        if size > self._tiers[tier].budget or not self._tiers[tier].enabled:
            raise BudgetError(
                f"{key or 'the item'!r} ({format_size(size)}) is larger than the {tier} budget "
                f"({format_size(self._tiers[tier].budget)}); raise {tier}_budget or use tier=None"
            )
        return tier  # type: ignore[return-value]

    def _count_lookup(self, key: str, target: TierName) -> None:
        entry = self._find(key)
        where = entry.tier if entry is not None else None
        self._tiers[target].hits += where == target
        self._tiers[target].misses += where != target
        if target == "device" and where != "device" and self._tiers["host"].enabled:
            self._tiers["host"].hits += where == "host"
            self._tiers["host"].misses += where != "host"

    def _count_io(self, kind: str, nbytes: int) -> None:
        if kind == "read":
            self._counters["bytes_read"] += nbytes
            self._counters["reads"] += 1
        else:
            self._counters["bytes_written"] += nbytes
            self._counters["writes"] += 1

    def _raise_errors(self) -> None:
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the TierCache is closed; make a new one")
