"""The machinery under :class:`~tierswap.TierCache`: budgets, eviction, prefetch and I/O.

Private to :mod:`tierswap.cache`.

Locking: one lock guards all state. Store calls that start I/O (``get_async``/``put_async``,
``info``) are never made while holding it; they are queued as *launches* and run right after
the lock is released, by the calling thread or by the cache's pump thread. I/O completion
callbacks only update state under the lock and wake waiters; the pump thread then plans the
prefetches that the freed bytes allow.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

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
    WriteBack,
)
from tierswap.config import format_size
from tierswap.engine.policies import EvictionPolicy
from tierswap.errors import BudgetError, ConfigError, StoreClosedError
from tierswap.tiers import DEVICE, HOST, TierName

if TYPE_CHECKING:
    from tierswap.store import ArrayInfo

# Outcomes of one prefetch attempt: started (or nothing to do); started, more to do later;
# waiting for write-backs it started; cannot get room yet.
_DONE, _PENDING, _WAITING, _BLOCKED = "done", "pending", "waiting", "blocked"
# Read-ahead looks at most this many scheduled items (or a tier's worth of bytes) per access.
_MAX_AHEAD = 256


class CacheStore(Protocol):
    """What a tier cache needs from the store under it (a :class:`~tierswap.SwapStore`)."""

    def info(self, key: str) -> ArrayInfo: ...

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]: ...

    def put_async(self, key: str, tensor: torch.Tensor) -> Future[None]: ...

    def put(self, key: str, tensor: torch.Tensor) -> None: ...

    def delete(self, key: str) -> None: ...

    def __contains__(self, key: object) -> bool: ...


class CacheCore:
    """State and internal operations of a tier cache; every method expects the lock held
    unless it says otherwise."""

    def __init__(
        self,
        store: CacheStore,
        policy: EvictionPolicy,
        device: torch.device,
        tiers: dict[TierName, Tier],
    ) -> None:
        self.store = store
        self.policy = policy
        self.device = device
        self._tiers = tiers
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
        self._demand_keys: Counter[str] = Counter()  # keys that blocked callers wait for
        self._counters = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}
        self._stall = 0.0
        self._pump_wanted = False
        self._closed = False
        self._pump = threading.Thread(target=self._pump_loop, name="tierswap-cache", daemon=True)
        self._pump.start()

    # ---------------------------------------------------- budgets and eviction
    def _reserve(
        self, tier: TierName, size: int, key: str, *, prefetch: bool, wait: bool = False
    ) -> bool:
        """Count ``size`` bytes as used in ``tier`` for ``key``, evicting as the policy says.

        A prefetch lets the policy refuse to evict (do no harm). Bytes of dirty victims come
        back, once written, earmarked for the key they were evicted for, so a read never takes
        room another one is waiting for. Returns ``False`` when the bytes are not there yet,
        after one wait for them with ``wait=True`` (the lock was released: look again).
        """
        t = self._tiers[tier]
        if size > t.budget:
            raise BudgetError(f"{format_size(size)} cannot fit the {tier} budget")
        mine = t.earmarks.get(key, 0)
        if prefetch and t.demand_waiting and mine < size:
            return False  # a blocked get/put goes first: prefetches must not take free bytes
        while t.free + mine < size:
            if t.free + mine + t.promised.get(key, 0) < size:
                victim = t.victim(self.policy, key if prefetch else None, strict=prefetch)
                if victim is not None:
                    self._evict(victim, demote=True, for_key=key)
                    continue
                if not prefetch and self._release_earmarks(t, but=key):
                    continue  # a demand takes room that prefetches had set aside
            if wait:
                self._wait_for_room(t, size, key)
            return False
        t.used += size - t.earmarks.pop(key, 0)  # leftover earmarked bytes are freed
        return True

    def _coming(self, tier: TierName, size: int, key: str) -> bool:
        """True when the bytes ``key`` waits for are on their way (write-backs in flight)."""
        t = self._tiers[tier]
        return t.free + t.earmarks.get(key, 0) + t.promised.get(key, 0) >= size

    def _release_earmarks(self, t: Tier, *, but: str | None = None) -> bool:
        """Free bytes earmarked for keys other than ``but``; whether there were any."""
        released = False
        for key in [k for k in t.earmarks if k != but]:
            t.used -= t.earmarks.pop(key)
            released = True
        if released:
            self._cv.notify_all()
        return released

    def _release_unwanted(self) -> None:
        """Free earmarked bytes of keys nobody waits for or queues any more."""
        queued = {k for k, _ in self._explicit} | {k for k, _ in self._auto}
        for t in self._tiers.values():
            for key in [k for k in t.earmarks if not self._wants(k, queued)]:
                t.used -= t.earmarks.pop(key)
                self._cv.notify_all()

    def _wants(self, key: str, queued: set[str] | None = None) -> bool:
        if self._find(key) is not None:
            return False
        if queued is None:
            queued = {k for k, _ in self._explicit} | {k for k, _ in self._auto}
        return key in self._demand_keys or key in queued

    def _wait_for_room(self, t: Tier, size: int, key: str) -> None:
        """One wait for bytes to free up in ``t``; prefetches stand back meanwhile."""
        timeout = self._check_pins(t, size)
        me = threading.get_ident()
        t.demand_waiting += 1
        self._blocked.add(me)
        self._demand_keys[key] += 1
        try:
            self._wait(timeout)
        finally:
            t.demand_waiting -= 1
            self._blocked.discard(me)
            self._demand_keys[key] -= 1
            if not self._demand_keys[key]:
                del self._demand_keys[key]

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

    def _evict(self, entry: Entry, *, demote: bool, for_key: str | None = None) -> None:
        """Take a ready, unheld entry out of its tier: demote, write back, or drop.

        The bytes of a written-back victim are earmarked for ``for_key`` once written.
        """
        if demote and entry.tier == DEVICE and self._demote(entry):
            return
        t = self._tiers[entry.tier]
        del t.entries[entry.key]
        if not entry.dirty:
            t.used -= entry.size
            self._cv.notify_all()
            return
        wb = WriteBack(entry, for_key)
        self._writing[entry.key] = wb
        t.writing += entry.size
        if for_key is not None:
            t.promised[for_key] = t.promised.get(for_key, 0) + entry.size
        self._launches.append(lambda: self._launch_write(wb))

    def _demote(self, entry: Entry) -> bool:
        """Move a device victim to host if host has room, evicting only clean, later items."""
        host = self._tiers[HOST]
        if entry.size > host.budget:
            return False
        while host.free < entry.size:
            victim = host.victim(self.policy, entry.key, clean_only=True)
            if victim is None:
                return False
            self._evict(victim, demote=False)
        host.used += entry.size
        self._relocate(entry, HOST)
        return True

    def _move(self, entry: Entry, target: TierName, *, prefetch: bool) -> bool:
        raise NotImplementedError  # the cache class above moves entries between tiers

    def _relocate(self, entry: Entry, target: TierName) -> None:
        raise NotImplementedError

    def _new_loading(self, key: str, meta: Meta, tier: TierName) -> Entry:
        raise NotImplementedError

    # --------------------------------------------------------------- prefetch
    def _queue_lookahead(self, tier: TierName) -> None:
        upcoming = self.policy.upcoming()
        self._auto = []
        self._auto_iter = ((k, tier) for k in upcoming)
        self._plan_prefetches()

    def _plan_prefetches(self) -> None:
        """Start what the prefetch queues allow now (under the lock; never waits)."""
        self._explicit = self._run_queue(self._explicit, None)
        budget = self._tiers[HOST].budget + self._tiers[DEVICE].budget
        self._auto = self._run_queue(self._auto, self._auto_iter, budget)
        self._release_unwanted()

    def _run_queue(
        self,
        queue: list[tuple[str, TierName]],
        more: Iterator[tuple[str, TierName]] | None,
        budget: int = 0,
    ) -> list[tuple[str, TierName]]:
        kept: list[tuple[str, TierName]] = []
        seen = looked = 0
        items = itertools.chain(queue, more) if more is not None else iter(queue)
        for item in items:
            outcome = self._try_prefetch(*item)
            if outcome != _DONE:
                kept.append(item)
            if outcome == _WAITING and more is None:
                continue  # explicit prefetches: the next may evict for itself meanwhile
            if outcome in (_BLOCKED, _WAITING):
                kept.extend(itertools.islice(items, len(queue)))  # keep the queued rest
                break
            meta = self._meta.get(item[0])
            seen += meta.footprint if meta else 0
            looked += 1
            if more is not None and (seen > budget or looked >= _MAX_AHEAD):
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
            if entry.tier in (tier, DEVICE):
                return _DONE
            if entry.state == LOADING:
                return _PENDING
            if entry.pins or entry.state != READY:
                return _DONE
            self.policy.admit(key)
            if self._move(entry, tier, prefetch=True):
                return _DONE
            return _WAITING if self._coming(tier, entry.size, key) else _BLOCKED
        if key in self._writing:
            return _BLOCKED
        load_tier: TierName = HOST if meta.footprint <= self._tiers[HOST].budget else tier
        self.policy.admit(key)
        if not self._reserve(load_tier, meta.footprint, key, prefetch=True):
            return _WAITING if self._coming(load_tier, meta.footprint, key) else _BLOCKED
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

    def _discard(self, entry: Entry) -> None:
        t = self._tiers[entry.tier]
        del t.entries[entry.key]
        t.used -= entry.size
        self._cv.notify_all()

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
                    self._launches.append(functools.partial(self._launch_flush, entry))
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
                self._tiers[entry.tier].bytes_in += entry.meta.nbytes
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
            if wb.for_key is not None:
                t.promised[wb.for_key] -= entry.size
                if not t.promised[wb.for_key]:
                    del t.promised[wb.for_key]
            if error is not None:  # keep the data: back in its tier, dirty; report it next call
                t.entries[entry.key] = entry
                self._errors.append(error)
            elif wb.for_key is not None and self._wants(wb.for_key):
                t.earmarks[wb.for_key] = t.earmarks.get(wb.for_key, 0) + entry.size
            else:
                t.used -= entry.size
            if error is None:
                self._count_io("written", entry.meta.nbytes)
                t.bytes_out += entry.meta.nbytes
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
                self._tiers[entry.tier].bytes_out += entry.meta.nbytes
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
        """Under the lock: run queued launches (lock released), or wait for a state change.

        Time spent here by a caller (not the pump thread) counts as stall.
        """
        start = time.perf_counter()
        if self._launches:
            self._run_launches()
        else:
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
        return tier

    def _count_lookup(self, key: str, target: TierName) -> None:
        entry = self._find(key)
        where = entry.tier if entry is not None else None
        self._tiers[target].hits += where == target
        self._tiers[target].misses += where != target
        if target == DEVICE and where != DEVICE and self._tiers[HOST].enabled:
            self._tiers[HOST].hits += where == HOST
            self._tiers[HOST].misses += where != HOST

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
