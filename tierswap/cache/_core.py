"""Residency under :class:`~tierswap.TierCache`: room in each tier, eviction, moves, and I/O.

Private to :mod:`tierswap.cache`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from tierswap.cache._gate import Gate
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
from tierswap.engine import Disk, StoreProtocol, Transfers, allocate, completed
from tierswap.engine.policies import EvictionPolicy
from tierswap.errors import BudgetError, ConfigError
from tierswap.tiers import DEVICE, HOST, TierName


class CacheStore(StoreProtocol, Protocol):
    """What a tier cache needs from the store under it (a :class:`~tierswap.SwapStore`): the
    engine's store protocol (its bytes move through a :class:`~tierswap.engine.Disk`), and
    deletes and membership."""

    def delete(self, key: str) -> None: ...

    def __contains__(self, key: object) -> bool: ...


class CacheCore:
    """Which item is in which tier, the room each needs, and the I/O that fills and empties them.

    Owns the item metadata, the write-backs in flight (reads of those keys wait for them), the
    callers blocked for room and the engine :class:`~tierswap.engine.Disk`; holds the
    :class:`Tier` books and the :class:`Gate`. Every method expects the gate's lock held unless
    it says otherwise; store calls are deferred to the gate, and their completions (``_loaded``,
    ``_written``, ``_moved``) take the lock. ``queued()`` names the keys the prefetch queues
    still want (their room is kept for them)."""

    def __init__(
        self,
        store: CacheStore,
        policy: EvictionPolicy,
        tiers: dict[TierName, Tier],
        gate: Gate,
        queued: Callable[[], set[str]],
        *,
        transfers: Transfers,
    ) -> None:
        self.store = store
        self.disk = Disk(store, gate.cv)
        self.transfers = transfers  # host <-> device copies (the engine's one path for them)
        self.policy = policy
        self.tiers = tiers
        self.gate = gate
        self.cv = gate.cv
        self.meta: dict[str, Meta] = {}
        self.write_backs: dict[str, WriteBack] = {}
        self.blocked: set[int] = set()  # threads waiting for room (pin deadlock detection)
        self._demand_keys: Counter[str] = Counter()  # keys that blocked callers wait for
        self.copy_errors: list[BaseException] = []  # of moves between tiers, not raised yet
        self._queued = queued

    # ---------------------------------------------------------------- lookups
    def find(self, key: str) -> Entry | None:
        for t in self.tiers.values():
            entry = t.entries.get(key)
            if entry is not None:
                return entry
        return None

    def meta_for(self, key: str) -> Meta:
        """``key``'s dtype, shape and size, looked up in the store if need be (lock not held)."""
        with self.cv:
            meta = self.meta.get(key)
        if meta is not None:
            return meta
        meta = Meta.of_info(self.store.info(key))  # KeyNotFoundError when the store lacks it
        with self.cv:
            return self.meta.setdefault(key, meta)

    def stored_meta(self, key: str) -> Meta | None:
        """``key``'s metadata in the store, or ``None`` (lock not held). ``None`` also when the
        lookup fails otherwise: the caller forgets the metadata, and the next use of the key looks
        it up again."""
        try:
            return Meta.of_info(self.store.info(key))
        except Exception:  # KeyNotFoundError, usually; any failure: see above
            return None

    def tier_for(self, tier: str | None, meta: Meta | None, key: str = "") -> TierName:
        """The tier an item of ``meta`` goes to when asked for ``tier`` (checked: it fits)."""
        if tier is not None and tier not in TIERS:
            raise ConfigError(f"tier={tier!r} must be 'device', 'host' or None")
        size = meta.footprint if meta is not None else 0
        if tier is None:
            fits = [n for n in TIERS if self.tiers[n].enabled and size <= self.tiers[n].budget]
            if not fits:
                raise BudgetError(
                    f"{key!r} ({format_size(size)}) fits neither the device nor the host budget; "
                    "raise host_budget or read it with store.get()"
                )
            return fits[0]
        if size > self.tiers[tier].budget or not self.tiers[tier].enabled:
            raise BudgetError(
                f"{key or 'the item'!r} ({format_size(size)}) is larger than the {tier} budget "
                f"({format_size(self.tiers[tier].budget)}); raise {tier}_budget or use tier=None"
            )
        return tier

    def count_lookup(self, key: str, target: TierName) -> None:
        """A use of ``key`` at ``target``: a hit where it is, a miss in the tiers it is not."""
        entry = self.find(key)
        where = entry.tier if entry is not None else None
        self.tiers[target].ledger.count_use(hit=where == target)
        if target == DEVICE and where != DEVICE and self.tiers[HOST].enabled:
            self.tiers[HOST].ledger.count_use(hit=where == HOST)

    # ---------------------------------------------------------------- room
    def reserve(
        self, tier: TierName, size: int, key: str, *, prefetch: bool, wait: bool = False
    ) -> bool:
        """Count ``size`` bytes as used in ``tier`` for ``key``, evicting as the policy says. A
        prefetch lets the policy refuse to evict (do no harm). Bytes of dirty victims come back,
        once written, earmarked for the key they were evicted for, so a read never takes room
        another one is waiting for. Returns ``False`` when the bytes are not there yet, after one
        wait for them with ``wait=True`` (the lock was released: look again)."""
        t = self.tiers[tier]
        if size > t.budget:
            raise BudgetError(f"{format_size(size)} cannot fit the {tier} budget")
        if prefetch and t.demand_waiting and t.earmarks.get(key, 0) < size:
            return False  # a blocked get/put goes first: prefetches must not take free bytes
        while t.room(key) < size:
            if not self._make_room(t, size, key, prefetch=prefetch):
                if wait:
                    self.wait_for_room(t, size, key)
                return False
        return t.take(size, key)

    def _make_room(self, t: Tier, size: int, key: str, *, prefetch: bool) -> bool:
        """Evict one victim for ``key`` (a demand may also free others' earmarks); ``False``
        when nothing can go now, or the room is already on its way (write-backs)."""
        if t.coming(key, size):
            return False
        victim = t.victim(self.policy, key if prefetch else None, strict=prefetch)
        if victim is not None:
            self.evict(victim, demote=True, for_key=key)
            return True
        return not prefetch and t.release_earmarks(lambda k: k == key)

    def release_unwanted(self, queued: set[str]) -> None:
        """Free earmarked bytes of keys nobody waits for or queues any more."""
        for t in self.tiers.values():
            t.release_earmarks(lambda key: self.wants(key, queued))

    def wants(self, key: str, queued: set[str] | None = None) -> bool:
        """Whether a blocked caller or a prefetch queue still waits to read ``key``."""
        if self.find(key) is not None:
            return False
        return key in self._demand_keys or key in (queued if queued is not None else self._queued())

    def wait_for_room(self, t: Tier, size: int, key: str) -> None:
        """One wait for bytes to free up in ``t``, the caller blocked and ``key`` wanted
        meanwhile; prefetches stand back."""
        timeout = self._check_pins(t, size)
        self._demand_keys[key] += 1
        try:
            with self.blocked_on(), t.demanded():
                self.gate.wait(timeout)
        finally:
            self._demand_keys -= Counter({key: 1})  # a count that reaches 0 leaves

    def _check_pins(self, t: Tier, size: int) -> float | None:
        """Raise when waiting for room could never end; else how long to wait (None: a wake). Pins
        held by other threads that are not themselves blocked here will be released, so the caller
        waits for them (polling: unpinning is not an event it can miss safely)."""
        pinned = sum(e.size for e in t.entries.values() if e.pins)
        if pinned + size <= t.budget and (t.unsettled() or self.gate.pending):
            return None
        holders = {tid for e in t.entries.values() for tid in e.pinners}
        others = holders - self.blocked - {threading.get_ident()}
        if others:
            return 0.05
        raise BudgetError(
            f"the {t.name} tier cannot hold {format_size(size)} more: "
            f"{format_size(pinned)} of its {format_size(t.budget)} budget is pinned; "
            f"pin fewer items at once or raise {t.name}_budget"
        )

    @contextlib.contextmanager
    def blocked_on(self) -> Iterator[None]:
        """Count the calling thread as blocked (waiting on other threads) for the block."""
        me = threading.get_ident()
        self.blocked.add(me)
        try:
            yield
        finally:
            self.blocked.discard(me)

    # ---------------------------------------------------------------- eviction and moves
    def evict(self, entry: Entry, *, demote: bool, for_key: str | None = None) -> None:
        """Take a ready, unheld entry out of its tier: demote, write back, or drop. The bytes of a
        written-back victim are earmarked for ``for_key`` once written."""
        if demote and entry.tier == DEVICE and self._demote(entry, for_key):
            return
        t = self.tiers[entry.tier]
        if not entry.dirty:
            t.discard(entry)
            return
        wb = WriteBack(entry, for_key)
        self.write_backs[entry.key] = wb
        t.start_write(entry, for_key)
        self.gate.defer(lambda: self._launch_write(entry, wb))

    def _demote(self, entry: Entry, for_key: str | None) -> bool:
        """Move a device victim to host if host has room, evicting only clean, later items."""
        host = self.tiers[HOST]
        if entry.size > host.budget:
            return False
        while host.free < entry.size:
            victim = host.victim(self.policy, entry.key, clean_only=True)
            if victim is None:
                return False
            self.evict(victim, demote=False)
        host.take(entry.size)
        self.relocate(entry, HOST, for_key)
        return True

    def discard(self, entry: Entry) -> None:
        """Drop ``entry`` from its tier without writing it."""
        self.tiers[entry.tier].discard(entry)

    def move(self, entry: Entry, target: TierName, *, prefetch: bool) -> bool:
        """Move a ready entry to ``target`` (a host<->device copy, no disk I/O). Returns ``False``
        when there is no room yet; a demand move then waits for room without holding the entry (two
        moves in opposite directions must not wait on each other)."""
        entry.claims += 1  # demoting victims into our tier must not evict the entry itself
        try:
            ok = self.reserve(target, entry.size, entry.key, prefetch=prefetch)
        finally:
            entry.claims -= 1
        if ok:
            self.relocate(entry, target)
        elif not prefetch:
            self.wait_for_room(self.tiers[target], entry.size, entry.key)
        return ok

    def relocate(self, entry: Entry, target: TierName, for_key: str | None = None) -> None:
        """Move ``entry`` into ``target`` (its bytes reserved there). It is there at once,
        loading until its copy, started once the lock is released (through the engine's
        transfer layer: on a GPU, a side stream), has landed. Its old bytes count as a
        write-back's until then, since the copy reads them (promised to ``for_key`` when the
        move makes room for it); a failed copy puts the entry back."""
        origin, source, leaving = entry.tier, entry.tensor, WriteBack(entry, for_key)
        self.tiers[origin].start_write(entry, for_key)
        entry.tier, entry.state = target, LOADING
        entry.tensor = self._buffer(self.tiers[target], entry.meta)
        self.tiers[target].add(entry)
        self.gate.defer(lambda: self._launch_move(leaving, origin, source))

    def _launch_move(self, leaving: WriteBack, origin: TierName, source: torch.Tensor) -> None:
        """Start the copy of ``leaving``'s entry from ``source``, in ``origin`` (lock not
        held)."""
        entry = leaving.entry
        try:
            landed = self.start_copy(entry.tensor, entry.tier, source, from_device=origin == DEVICE)
        except BaseException as exc:
            self._moved(leaving, origin, source, exc)
            return
        landed.add_done_callback(lambda f: self._moved(leaving, origin, source, f.exception()))

    def _moved(
        self,
        leaving: WriteBack,
        origin: TierName,
        source: torch.Tensor,
        error: BaseException | None,
    ) -> None:
        """A move's copy ended: the entry is ready where it went, and its old bytes are free
        (or earmarked for the key the move made room for); or it failed, and the entry is back
        where it was (the next call raises the error)."""
        entry = leaving.entry
        with self.cv:
            src, dst = self.tiers[origin], self.tiers[entry.tier]
            if error is None:
                entry.state = READY
                src.ledger.count_moved(out=entry.meta.nbytes)
                dst.ledger.count_moved(into=entry.meta.nbytes)
            else:
                dst.discard(entry)
                entry.tier, entry.tensor, entry.state = origin, source, READY
                self.copy_errors.append(error)
            wanted = leaving.for_key is not None and self.wants(leaving.for_key)
            src.end_write(leaving, failed=error is not None, earmark=error is None and wanted)
            self.gate.wake()

    def raise_errors(self) -> None:
        """Raise the first failure of a write-behind (the disk's), else of a move's copy, not
        raised yet."""
        self.disk.raise_errors()
        errors, self.copy_errors = self.copy_errors, []
        if errors:
            raise errors[0]

    def new_loading(self, key: str, meta: Meta, tier: TierName) -> Entry:
        """An entry for ``key`` in ``tier`` (bytes reserved) and its read, deferred."""
        t = self.tiers[tier]
        entry = Entry(key, meta, tier, self._buffer(t, meta), state=LOADING)
        t.add(entry)
        self.gate.defer(lambda: self._launch_load(entry))
        return entry

    def add_copy(self, key: str, tensor: torch.Tensor, meta: Meta, tier: TierName) -> None:
        """A dirty entry holding a copy of ``tensor`` in ``tier`` (bytes reserved)."""
        t = self.tiers[tier]
        try:
            buf = self._buffer(t, meta)
            self.start_copy(buf, tier, tensor, from_device=tensor.device.type != "cpu").result()
        except BaseException:  # no entry joins: its bytes go back, the books stay balanced
            t.untake(meta.footprint)
            raise
        t.add(Entry(key, meta, tier, buf, dirty=True))

    def start_copy(
        self, buf: torch.Tensor, tier: TierName, source: torch.Tensor, *, from_device: bool
    ) -> Future[None]:
        """Start copying ``source`` into ``buf``, memory of ``tier``: into the device tier, or
        out of device memory (``from_device``), through the engine's transfer layer; host to
        host, a plain copy. The future of the moment ``buf`` holds the bytes (and the copy no
        longer reads ``source``)."""
        if self.transfers.moves and tier == DEVICE:
            return self.transfers.to_device(source, buf).done
        if self.transfers.moves and from_device:
            return self.transfers.to_host(source, buf.view(-1)).done
        with torch.no_grad():  # a copy, never recorded by autograd (as the transfer layer's)
            buf.copy_(source.detach())
        return completed()

    @staticmethod
    def _buffer(t: Tier, meta: Meta) -> torch.Tensor:
        """A buffer for ``meta`` in ``t``'s memory (host buffers pinned when CUDA is present)."""
        return allocate(meta.shape, meta.dtype, t.device, pin=None if t.name == HOST else False)

    # ---------------------------------------------------------------- writes
    def dirty_moving(self) -> bool:
        """Whether a dirty entry is moving between tiers (loading where it went)."""
        return any(
            e.dirty and e.state == LOADING for t in self.tiers.values() for e in t.entries.values()
        )

    def start_flush(self) -> list[Entry]:
        """Start writing every dirty, ready entry (it stays, clean once written)."""
        flushing = []
        for t in self.tiers.values():
            for entry in t.entries.values():
                if entry.dirty and entry.state == READY:
                    entry.dirty, entry.state = False, FLUSHING
                    flushing.append(entry)
                    self.gate.defer(functools.partial(self._launch_write, entry, None))
        return flushing

    def begin_write_through(self, key: str, meta: Meta, tensor: torch.Tensor) -> None:
        """Reads of ``key`` wait (as for a write-back) until the store has ``tensor``. The key's
        cached entry leaves its tier. A dirty one holds a value the store does not have yet, so it
        is set aside like a write-back victim (its bytes still counted) until the write ends: a
        failed write-through puts it back, and the key keeps the value it had instead of the older
        one in the store (or none at all)."""
        entry = self.find(key)
        if entry is not None and entry.dirty:
            self.tiers[entry.tier].start_write(entry, None)
            self.write_backs[key] = WriteBack(entry)
            return
        if entry is not None:
            self.discard(entry)
        self.write_backs[key] = WriteBack(Entry(key, meta, HOST, tensor), through=True)

    def end_write_through(self, key: str, *, ok: bool, stored: Meta | None = None) -> None:
        """The write-through of ``key`` ended; after a failure the key's metadata is that of its
        set-aside entry, or ``stored`` (what the store holds: ``None`` when it lacks the key)."""
        wb = self.write_backs.pop(key)
        if not wb.through:  # the replaced dirty entry: freed once written, back on failure
            self.tiers[wb.entry.tier].end_write(wb, failed=not ok, earmark=False)
        if not ok and not wb.through:
            self.meta[key] = wb.entry.meta
        elif not ok and stored is not None:  # the store still holds the old value
            self.meta[key] = stored
        elif not ok:
            self.meta.pop(key, None)
        self.gate.wake()

    # ---------------------------------------------------------------- I/O (lock not held)
    def _launch_load(self, entry: Entry) -> None:
        direct = not self._through_transfers(entry)  # the store reads into the entry's memory
        try:
            future = self.disk.read(entry.key, out=entry.tensor if direct else None)
        except BaseException as exc:
            self._loaded(entry, None, exc)
            return
        future.add_done_callback(lambda f: self._loaded(entry, f, None))

    def _through_transfers(self, entry: Entry) -> bool:
        """Whether ``entry``'s memory is the device's, reached through the transfer layer."""
        return self.transfers.moves and entry.tier == DEVICE

    def _loaded(self, entry: Entry, future: Any, error: BaseException | None) -> None:
        """A read ended (``future``), or the copy to the device that follows it (``future`` is
        ``None``; ``error`` its failure): the entry is ready, or failed."""
        try:
            if future is not None:
                result = future.result()
                if self._through_transfers(entry):  # the copy in ends the load; none waits here
                    done = self.start_copy(entry.tensor, DEVICE, result, from_device=False)
                    done.add_done_callback(lambda f: self._loaded(entry, None, f.exception()))
                    return
        except BaseException as exc:
            error = exc
        with self.cv:
            if error is None:
                entry.state = READY
                self.tiers[entry.tier].ledger.count_moved(into=entry.meta.nbytes)
            else:
                entry.state, entry.error = FAILED, error
                self.discard(entry)
            self.gate.wake()

    def _launch_write(self, entry: Entry, wb: WriteBack | None) -> None:
        """Write ``entry`` down: evicted (``wb``, its write-back) or flushed (it stays)."""
        self.disk.write({entry.key: entry.tensor}, then=lambda e: self._written(entry, wb, e))

    def _written(self, entry: Entry, wb: WriteBack | None, error: BaseException | None) -> None:
        """A write ended. A write-back that failed keeps the data (back in its tier, dirty; the
        disk reports the failure to the next call); a written one frees or earmarks its bytes.
        A flushed entry stays, clean once written, dirty again when the write failed."""
        with self.cv:
            t = self.tiers[entry.tier]
            if wb is not None:
                del self.write_backs[entry.key]
                earmark = error is None and wb.for_key is not None and self.wants(wb.for_key)
                t.end_write(wb, failed=error is not None, earmark=earmark)
            else:
                entry.state, entry.dirty = READY, entry.dirty or error is not None
            if error is None:
                t.ledger.count_moved(out=entry.meta.nbytes)
            self.gate.wake()
