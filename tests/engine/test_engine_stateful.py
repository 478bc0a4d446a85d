"""Hypothesis state machine: the engine's parts driven as a front end drives them.

The machine is a front end of its own over a real :class:`~tierswap.SwapStore`: it reserves
room in a host :class:`~tierswap.engine.Ledger`, takes pooled buffers from a
:class:`~tierswap.engine.BufferPool` and reads regions into them through a
:class:`~tierswap.engine.Disk`, consumes the reads, changes the buffers and writes them
behind (sometimes after a future that completes later: a copy back from the device landing),
keeps some regions resident and writes them back later, and gives bytes and buffers back in
each write's ``then``. A wrapper store (:class:`FlakyStore`) delays the I/O and fails the next
read or write when a rule arms it: by raising from the call, by a future that fails, or (writes)
by a failure reported after the data reached the store; a copy back may fail too.

After every step the machine checks:

- the books balance: ``ledger.used`` is the bytes of the reads in flight and consumed, of the
  buffers of writes in flight and of the resident regions; ``0 <= used <= budget``; idle pooled
  buffers never exceed ``ledger.free``;
- every read that completes, and the whole store after :meth:`Disk.wait`, holds what the dict
  model says. A failed write may or may not have landed: the model keeps, per slot, the values
  it may hold (each failed write's and the last before them that surely landed), so the
  comparisons go on after any failure;
- every injected failure is raised exactly once: a read's at its future (or from the call), a
  write's or a copy's by :meth:`Disk.raise_errors`, after its write's ``then`` heard it. One
  write failure is outstanding at a time: ``raise_errors`` raises the first and forgets others.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.machines import FlakyStore, InjectedFault, threaded_settings
from tierswap import SwapStore
from tierswap.engine import BufferPool, Disk, Ledger, Region, overlap
from tierswap.io import footprint

CHUNK = 4096
SLOT = 512  # float32 elements: half a chunk, the model's unit
SLOTS = 16  # slots per key: eight chunks
KEYS = ("a", "b")
PAGE = 4096
SETTLE_SECONDS = 10.0  # far above any step's I/O: longer is a hang
REGIONS = [
    Region(key, first * SLOT, (first + length) * SLOT)
    for key in KEYS
    for first in range(SLOTS)
    for length in (1, 2, 3, 5)
    if first + length <= SLOTS
]
# a fault to arm before a read or a write: none (most often), or how the call fails
READ_FAULTS = st.sampled_from([None] * 6 + ["raise", "fail"])
WRITE_FAULTS = st.sampled_from([None] * 6 + ["raise", "fail", "late"])
DISK_ACTIONS = st.sampled_from(
    ["raise", "wait", "wait, a copy failing", "slow", "fast", "raise", "fail", "late"]
)
# what the machine does with a read it consumed: change it and write it behind (most often),
# write it unchanged, keep it for later, keep it resident, or give it back
THEN = st.sampled_from(["change", "change", "write", "keep", "resident", "drop"])
# how a write gets its bytes: at once, from a copy already landed, or from one landing later
AFTER = st.sampled_from([None, "landed", "later", "later"])

Slot = tuple[str, int]


@dataclasses.dataclass(eq=False)
class _Write:
    """One write the machine handed to the disk: the value it puts in each slot, and its end."""

    slots: dict[Slot, torch.Tensor]
    nbytes: int = 0  # what its end gives back to the ledger
    ended: bool = False
    error: BaseException | None = None

    @property
    def landed(self) -> bool:
        return self.ended and self.error is None


class _Model:
    """What the store may hold, per slot: the values written, newest last, each with its write
    (``None``: the first value). The candidates are the newest values back to the newest that
    surely landed; a failed write (or one not ended) may or may not have landed."""

    def __init__(self) -> None:
        self._log: dict[Slot, list[tuple[torch.Tensor, _Write | None]]] = {}

    def put(self, slot: Slot, value: torch.Tensor, write: _Write | None) -> None:
        self._log.setdefault(slot, []).append((value, write))

    def candidates(self, slot: Slot) -> list[torch.Tensor]:
        log = self._log[slot]
        found: list[torch.Tensor] = []
        for index in range(len(log) - 1, -1, -1):
            value, write = log[index]
            found.append(value)
            if write is None or write.landed:
                del log[:index]  # older values can never come back
                break
        return found


def _slots(region: Region, tensor: torch.Tensor) -> dict[Slot, torch.Tensor]:
    """``tensor`` (a region's values) cut into the model's slots."""
    first = region.start // SLOT
    return {
        (region.key, first + i): tensor[i * SLOT : (i + 1) * SLOT]
        for i in range(region.numel // SLOT)
    }


def _one_of(got: torch.Tensor, candidates: list[torch.Tensor]) -> bool:
    return any(torch.equal(got, c) for c in candidates)


@dataclasses.dataclass(eq=False)
class _Held:
    """Buffers the machine holds for some regions, their capacities reserved in the ledger."""

    tensors: dict[Region, torch.Tensor]
    nbytes: int
    read: Future[Any] | None = None


class EngineMachine(RuleBasedStateMachine):
    """A front end made of the engine's parts, one caller, against a :class:`_Model`."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-engine-sm-"))
        self.inner = SwapStore(self.dir / "s", mode="w", durable=False, chunk_bytes=CHUNK)
        self.model = _Model()
        for i, key in enumerate(KEYS):
            value = torch.arange(SLOTS * SLOT, dtype=torch.float32) + 100_000 * i
            self.inner.put(key, value)
            for slot, piece in _slots(Region(key, 0, value.numel()), value).items():
                self.model.put(slot, piece.clone(), None)
        self.store = FlakyStore(self.inner)
        self.cv = threading.Condition()
        self.disk = Disk(self.store, self.cv)
        self.pool = BufferPool()
        self.books = {"reading": 0, "loaded": 0, "writing": 0, "resident": 0}  # under cv
        self.reading: list[_Held] = []
        self.loaded: list[_Held] = []
        self.resident: dict[Region, torch.Tensor] = {}
        self.busy: set[Region] = set()  # resident regions being written back (under cv)
        self.unlanded: list[tuple[Future[None], _Write]] = []  # copies still to land
        self.writes: list[_Write] = []
        self.copy_faults: list[InjectedFault] = []
        self.heard: set[int] = set()  # ids of the failures a write's ``then`` heard
        self.reported: set[int] = set()  # ids of the failures raised to the machine
        self.timers: list[threading.Timer] = []
        self.then_errors: list[str] = []  # what the writes' thens found wrong (under cv)
        self.counter = 0

    @initialize(pages=st.integers(2, 10))
    def start(self, pages: int) -> None:
        self.ledger = Ledger("host", pages * PAGE, self.cv)

    # ------------------------------------------------------------ faults and their reports
    def _fired(self) -> list[InjectedFault]:
        with self.cv:
            return [*self.store.fired, *self.copy_faults]

    def _report(self, exc: BaseException) -> None:
        """``exc`` reached the machine: an injected fault, fired, raised for the first time."""
        if not isinstance(exc, InjectedFault):
            raise exc
        assert any(exc is fault for fault in self._fired()), exc
        assert id(exc) not in self.reported, f"{exc} was raised twice"
        self.reported.add(id(exc))
        event(f"an injected {exc.kind} failure ({exc.mode}) was raised")

    def _write_fault_outstanding(self) -> bool:
        """Whether a write failure is armed, or fired and not raised yet."""
        return self.store.write_fault is not None or any(
            f.kind != "read" and id(f) not in self.reported for f in self._fired()
        )

    def _copy_fault(self, write: _Write) -> InjectedFault:
        key = next(iter(write.slots))[0]
        fault = InjectedFault(errno.EIO, "copy", "fail", key)
        with self.cv:
            self.copy_faults.append(fault)
        return fault

    # ------------------------------------------------------------ books
    def _free(self, held: _Held, book: str) -> None:
        """Give ``held``'s buffers back to the pool and its bytes to the ledger."""
        with self.cv:
            for tensor in held.tensors.values():
                self.pool.give(tensor)
            self.ledger.release(held.nbytes)
            self.books[book] -= held.nbytes

    def _ended(
        self, write: _Write, regions: list[Region], held: _Held | None, error: BaseException | None
    ) -> None:  # fmt: skip
        """A write's ``then`` (on an I/O thread: what goes wrong is kept for the invariant):
        record its end; free its buffers (``held``) or, for a resident write-back that keeps
        them, let its ``regions`` change again."""
        with self.cv:
            if write.ended:
                self.then_errors.append("a write's then ran twice")
            if error is not None and (
                not isinstance(error, InjectedFault) or id(error) in self.heard
            ):
                self.then_errors.append(f"{error!r}: not injected, or it ended two writes")
            if error is not None:
                self.heard.add(id(error))
            write.ended, write.error = True, error
            if held is not None:
                self._free(held, "writing")
            else:
                self.busy.difference_update(regions)

    # ------------------------------------------------------------ the model
    def _check(self, region: Region, tensor: torch.Tensor) -> None:
        with self.cv:
            for slot, got in _slots(region, tensor).items():
                candidates = self.model.candidates(slot)
                assert _one_of(got, candidates), f"{slot} holds none of its values"
                if len(candidates) > 1:
                    event("a read compared against candidates (a failed write)")

    def _room_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit once the writes in flight end (those whose copy has not
        been landed yet do not end): if so, wait for them, as a front end waits for room. The
        decision never depends on the threads' timing, so Hypothesis can replay it. The
        caller holds the condition."""
        stuck = sum(write.nbytes for _, write in self.unlanded)
        books = self.books
        if (
            books["reading"] + books["loaded"] + books["resident"] + stuck + nbytes
            > self.ledger.budget
        ):
            return False
        deadline = time.monotonic() + SETTLE_SECONDS
        while self.ledger.free < nbytes:
            assert time.monotonic() < deadline, "the writes in flight never gave room back"
            self.cv.wait(0.01)
        return True

    def _holdings(self) -> list[Region]:
        held = [r for h in (*self.reading, *self.loaded) for r in h.tensors]
        return held + list(self.resident)

    def _free_regions(self, taken: list[Region]) -> list[Region]:
        return [r for r in REGIONS if not any(overlap(r, h) for h in taken)]

    # ------------------------------------------------------------ rules: reads
    @rule(data=st.data(), count=st.integers(1, 2), fault=READ_FAULTS, fail_copies=st.booleans())
    def read(self, data: st.DataObject, count: int, fault: str | None, fail_copies: bool) -> None:
        """Reserve room and take buffers for one or two regions and start reading them (after
        the writes they overlap, whose copies land from a timer: ``fail_copies``); a later
        :meth:`complete` consumes them."""
        held = self._start_read(data, count, fault, fail_copies)
        if held is not None:
            self.reading.append(held)

    @rule(data=st.data(), fault=READ_FAULTS, then=THEN, after=AFTER, write_fault=WRITE_FAULTS)
    def read_and_use(
        self, data: st.DataObject, fault: str | None, then: str, after: str | None,
        write_fault: str | None,
    ) -> None:  # fmt: skip
        """Read a region and consume the read at once, as a pipeline's job does."""
        held = self._start_read(data, 1, fault, fail_copies=False)
        if held is not None:
            self._consume(held, then, after, write_fault)

    def _start_read(
        self, data: st.DataObject, count: int, fault: str | None, fail_copies: bool
    ) -> _Held | None:
        """``count`` regions' reads started into buffers reserved for them (``None``: no
        region free, no room, or the read failed to start)."""
        regions: list[Region] = []
        for _ in range(count):
            free = self._free_regions(self._holdings() + regions)
            if free:
                regions.append(data.draw(st.sampled_from(free)))
        if not regions:
            return None
        sizes = [footprint(r.numel * 4) for r in regions]
        with self.cv:
            if not self._room_for(sum(sizes)):
                event("a read found no room")
                return None
            self.pool.trim(self.ledger.free - sum(sizes))
            assert self.ledger.try_reserve(sum(sizes))
            self.books["reading"] += sum(sizes)
            tensors = {r: self.pool.take(r.numel * 4)[: r.numel * 4].view(torch.float32)
                       for r in regions}  # fmt: skip
        held = _Held(tensors, sum(sizes))
        self._land_later(regions, fail_copies)
        if fault is not None:
            self.store.arm("read", fault)
        try:
            if len(regions) == 1:
                held.read = self.disk.read(regions[0], tensors[regions[0]])
            else:
                held.read = self.disk.read_all(tensors)
        except OSError as exc:
            self._report(exc)
            self._free(held, "reading")
            return None
        finally:
            self.store.read_fault = None
        return held

    def _land_later(self, regions: list[Region], fail: bool) -> None:
        """Land, from a timer, the copies of the writes the reads of ``regions`` overlap: the
        reads wait for those writes to reach the store."""
        for after, write in list(self.unlanded):
            if any(_in(r, write) for r in regions):
                self.unlanded.remove((after, write))
                error = (
                    self._copy_fault(write)
                    if fail and not self._write_fault_outstanding()
                    else None
                )
                timer = threading.Timer(0.001, _complete, (after, error))
                self.timers.append(timer)
                timer.start()
                event("a read waited for a write's copy to land")

    @precondition(lambda self: self.reading)
    @rule(data=st.data(), then=THEN, after=AFTER, fault=WRITE_FAULTS)
    def complete(
        self, data: st.DataObject, then: str, after: str | None, fault: str | None
    ) -> None:
        """Consume a read started before: as :meth:`read` does with ``now``."""
        held = self.reading.pop(data.draw(st.integers(0, len(self.reading) - 1)))
        self._consume(held, then, after, fault)

    def _consume(self, held: _Held, then: str, after: str | None, fault: str | None) -> None:
        """Wait for a read, compare what it read, then use its buffers (:meth:`_use`)."""
        assert held.read is not None
        try:
            held.read.result(timeout=SETTLE_SECONDS)
        except OSError as exc:
            self._report(exc)
            self._free(held, "reading")
            return
        for region, tensor in held.tensors.items():
            self._check(region, tensor)
        self._move(held, "reading", "loaded")
        self.loaded.append(held)
        self._use(held, then, after, fault)

    @precondition(lambda self: self.loaded)
    @rule(data=st.data(), then=THEN, after=AFTER, fault=WRITE_FAULTS)
    def use(self, data: st.DataObject, then: str, after: str | None, fault: str | None) -> None:
        """Use a consumed read now: as :meth:`complete` does."""
        self._use(data.draw(st.sampled_from(self.loaded)), then, after, fault)

    def _use(self, held: _Held, then: str, after: str | None, fault: str | None) -> None:
        if then == "keep":
            return
        self.loaded.remove(held)
        if then == "drop":  # given back unwritten (changes, if any, dropped)
            self._free(held, "loaded")
        elif then == "resident":
            self._move(held, "loaded", "resident")
            self.resident.update(held.tensors)
        else:  # "write", or "change" first
            if then == "change":
                self.counter += 1
                for tensor in held.tensors.values():
                    tensor.add_(self.counter)
            self._move(held, "loaded", "writing")
            self._write(held.tensors, after, fault, held)

    def _move(self, held: _Held, book: str, to: str) -> None:
        with self.cv:
            self.books[book] -= held.nbytes
            self.books[to] += held.nbytes

    def _write(
        self, tensors: dict[Region, torch.Tensor], after: str | None, fault: str | None,
        held: _Held | None,
    ) -> None:  # fmt: skip
        """Write ``tensors`` behind, after a copy when ``after`` says; ``then`` frees ``held``
        (a resident write-back that keeps its buffers passes ``None``)."""
        if fault is not None and not self._write_fault_outstanding():
            self.store.arm("write", fault)
        write = _Write({s: v.clone() for r, t in tensors.items() for s, v in _slots(r, t).items()})
        write.nbytes = held.nbytes if held is not None else 0
        with self.cv:
            for slot, value in write.slots.items():
                self.model.put(slot, value, write)
        self.writes.append(write)
        landing: Future[None] | None = None
        if after is not None:
            landing = Future()
            if after == "landed":
                landing.set_result(None)
            else:
                self.unlanded.append((landing, write))
        self.disk.write(
            dict(tensors),
            after=landing,
            then=lambda error: self._ended(write, list(tensors), held, error),
        )

    @precondition(lambda self: self.unlanded)
    @rule(data=st.data(), fail=st.booleans())
    def land(self, data: st.DataObject, fail: bool) -> None:
        """A copy back from the device lands (or fails): its write goes to the store."""
        after, write = self.unlanded.pop(data.draw(st.integers(0, len(self.unlanded) - 1)))
        _complete(
            after, self._copy_fault(write) if fail and not self._write_fault_outstanding() else None
        )

    def _settle(self, regions: list[Region]) -> None:
        """Wait until no write-back of ``regions`` is in flight, landing its copy if need be:
        what a rule may draw never depends on the threads' timing."""
        for after, write in list(self.unlanded):
            if any(_in(r, write) for r in regions):
                self.unlanded.remove((after, write))
                _complete(after, None)
        deadline = time.monotonic() + SETTLE_SECONDS
        with self.cv:
            while self.busy.intersection(regions):
                assert time.monotonic() < deadline, "a write-back never ended"
                self.cv.wait(0.01)

    @precondition(lambda self: self.resident)
    @rule(
        data=st.data(),
        how=st.sampled_from(["change", "flush", "evict"]),
        after=AFTER,
        fault=WRITE_FAULTS,
    )
    def resident_regions(
        self, data: st.DataObject, how: str, after: str | None, fault: str | None
    ) -> None:
        """Change a resident region in place, or write resident regions back: kept (not
        changed until written) or evicted (freed once written)."""
        regions = list(self.resident)
        if how == "change":
            region = data.draw(st.sampled_from(regions))
            self._settle([region])
            self.counter += 1
            self.resident[region].add_(self.counter)
            return
        chosen = data.draw(st.lists(st.sampled_from(regions), min_size=1, unique=True))
        self._settle(chosen)
        tensors = {r: self.resident[r] for r in chosen}
        held: _Held | None = None
        with self.cv:
            if how == "evict":
                held = _Held(tensors, sum(footprint(r.numel * 4) for r in chosen))
                for region in chosen:
                    del self.resident[region]
                self._move(held, "resident", "writing")
            else:
                self.busy.update(chosen)
        self._write(tensors, after, fault, held)

    # ------------------------------------------------------------ rules: errors and the disk
    @rule(action=DISK_ACTIONS)
    def disk(self, action: str) -> None:
        """Raise what failed; wait for every write (landing every copy first, or failing one)
        and compare the store; slow the disk or speed it up; or arm a write fault for
        whatever write comes next (one handed when its copy lands, say)."""
        if action == "raise":
            self._raise_errors()
        elif action.startswith("wait"):
            self._wait_and_compare(fail=action == "wait, a copy failing")
        elif action in ("slow", "fast"):
            self.store.delay = 0.002 if action == "slow" else 0.0
        elif not self._write_fault_outstanding():
            self.store.arm("write", action)

    def _raise_errors(self) -> None:
        try:
            self.disk.raise_errors()
        except OSError as exc:
            self._report(exc)

    def _wait_and_compare(self, *, fail: bool) -> None:
        """Every write ended, its ``then`` run, and every write failure raised: the store
        holds what the model says."""
        self._land_all(fail)
        self.disk.wait()
        with self.cv:
            assert not self.disk.in_flight
            assert all(w.ended for w in self.writes), "wait() returned before a write's then"
            assert self.books["writing"] == 0
            assert not self.busy
        self._raise_errors()
        with self.cv:
            raised = {id(f) for f in self._fired() if f.kind != "read" and id(f) in self.reported}
            assert not any(f.kind != "read" and id(f) not in raised for f in self._fired()), (
                "a write failure was never raised"
            )
            assert self.heard == raised, "a failure raised that no write's then heard"
        for key in KEYS:
            self._check(Region(key, 0, SLOTS * SLOT), self.inner.get(key))

    def _land_all(self, fail: bool) -> None:
        """Land every copy still to land (the first failing, when ``fail``)."""
        for timer in self.timers:
            timer.join()
        self.timers.clear()
        while self.unlanded:
            after, write = self.unlanded.pop()
            failing = fail and not self._write_fault_outstanding()
            _complete(after, self._copy_fault(write) if failing else None)

    # ------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "ledger"):
            return
        with self.cv:
            assert not self.then_errors, self.then_errors
            assert self.ledger.used == sum(self.books.values()), (self.ledger.used, self.books)
            assert 0 <= self.ledger.used <= self.ledger.budget
            assert self.ledger.peak <= self.ledger.budget
            assert self.pool.idle <= self.ledger.free, (self.pool.idle, self.ledger.free)
            assert all(v >= 0 for v in self.books.values()), self.books

    def teardown(self) -> None:
        try:
            if hasattr(self, "ledger"):
                self._land_all(fail=False)
                self.disk.wait()
                for held in self.reading:
                    assert held.read is not None
                    if held.read.exception(timeout=SETTLE_SECONDS) is not None:
                        self._report(held.read.exception())
                self._raise_errors()
                unreported = [f for f in self._fired() if id(f) not in self.reported]
                assert not unreported, f"never raised: {unreported}"
        finally:
            self.store.close()
            self.inner.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def _in(region: Region, write: _Write) -> bool:
    """Whether ``write`` puts any slot of ``region``."""
    return any(overlap(region, Region(key, s * SLOT, (s + 1) * SLOT)) for key, s in write.slots)


def _complete(after: Future[None], error: BaseException | None) -> None:
    if error is None:
        after.set_result(None)
    else:
        after.set_exception(error)


EngineMachine.TestCase.settings = threaded_settings(max_examples=40, steps=25)
TestEngineMachine = EngineMachine.TestCase


@pytest.mark.slow
class TestEngineMachineDeep(EngineMachine.TestCase):
    """At the cache fault machine's depth (run with -m slow)."""

    settings = settings(EngineMachine.TestCase.settings, max_examples=150, stateful_step_count=40)
