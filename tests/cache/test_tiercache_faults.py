"""Hypothesis state machine: the cache against a dict model while the disk is slow and fails.

A wrapper store (:class:`FaultyStore`) delays reads and writes by a few milliseconds when a rule
slows the disk, and fails the next read or the next write when a rule arms it: by raising from
the call, by a future that fails, or (writes) by a failure reported after the data reached the
store. After
every step the machine checks what the cache promises (docs/cache.md, "Write-back"):

- a failing call raises the injected ``OSError`` itself, once: a failed read from the ``get``
  that waited for it, a failed write-back or flush from the next ``get``/``put``/``evict``/
  ``flush``, a failed write-through from its ``put``; a successful ``flush`` means every failed
  background write was reported;
- a failed write-back keeps the data cached and dirty, and a failed call changes no value: every
  key the model holds reads back bit-exact, and a retry of the call succeeds;
- the ledgers balance within their budgets, no lock is held, no claim, pin, blocked caller or
  demand is left registered, and the cache settles (no I/O left in flight) and closes.

A write-through whose failure is reported after its data landed leaves the key holding either
value: the model marks it unknown (the values it may hold) until it is put or deleted again.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.cache.books import assert_books_balance
from tests.machines import ArmedFaults, InjectedFault, raise_, threaded_settings
from tierswap import SwapStore, TierCache
from tierswap.cache._tiers import footprint
from tierswap.errors import BudgetError, KeyNotFoundError

PAGE = 4096
NAMES = ["a", "b/c", "d", "e"]
KEYS = st.sampled_from(NAMES)
TIERS = st.sampled_from([None, "host", "device"])
# float32 lengths: under a page, exactly one, a page and a bit, three pages
LENGTHS = st.sampled_from([10, 1024, 1100, 3072])
# a fault to arm before a call: none (most often), the next read's or the next write's
FAULTS = st.sampled_from(
    [None, None, None, *(("read", m) for m in ("raise", "fail")),
     *(("write", m) for m in ("raise", "fail", "late"))]
)  # fmt: skip
SETTLE_SECONDS = 10.0  # far above any step's I/O: a cache that takes longer has hung


class FaultyStore(ArmedFaults):
    """A store whose I/O is delayed, and whose next read or next write fails when armed.

    Delegates to a real :class:`~tierswap.SwapStore`. With ``delay`` > 0 each read and write
    runs on its own thread after the delay (the real store's synchronous call), so completions
    arrive late and out of order; with ``delay == 0`` the store's own async calls run. A fault
    is consumed by the first read (or write) that starts after it was armed, whatever its key;
    its kinds: ``"read"``, ``"write"`` (a background ``put_async``), ``"write-through"``
    (``put``). Thread-safe: the cache starts I/O from its callers' threads and its pump thread.
    """

    def __init__(self, inner: SwapStore) -> None:
        super().__init__()
        self.inner = inner
        self.delay = 0.0

    # ------------------------------------------------------------ what the cache calls
    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        fault = self._take("read", key)
        if fault is not None and fault.mode == "raise":
            raise fault
        if fault is not None:
            return self._later(lambda: raise_(fault))
        if not self.delay:
            return self.inner.get_async(key, out=out)
        return self._later(lambda: self.inner.get(key, out=out))

    def put_async(self, key: str, tensor: torch.Tensor) -> Future[None]:
        fault = self._take("write", key)
        if fault is not None and fault.mode == "raise":
            raise fault
        if fault is not None and fault.mode == "fail":
            return self._later(lambda: raise_(fault))
        if fault is not None:  # late: the data lands, then the error is reported
            return self._later(lambda: (self.inner.put(key, tensor), raise_(fault)))
        if not self.delay:
            return self.inner.put_async(key, tensor)
        return self._later(lambda: self.inner.put(key, tensor))

    def put(self, key: str, tensor: torch.Tensor) -> None:
        fault = self._take("write-through", key)
        time.sleep(self.delay)
        if fault is not None and fault.mode == "late":
            self.inner.put(key, tensor)
        if fault is not None:
            raise fault
        self.inner.put(key, tensor)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def info(self, key: str) -> Any:
        return self.inner.info(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def _later(self, call: Callable[[], Any]) -> Future[Any]:
        """``call()`` on a thread of its own after the delay, as a future."""
        future: Future[Any] = Future()
        delay = self.delay

        def run() -> None:
            time.sleep(delay)
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, name="faulty-store-io", daemon=True).start()
        return future


Value = torch.Tensor | None  # None: the key is absent
Fault = tuple[str, str] | None  # ("read" | "write", mode)


class FaultyCacheMachine(RuleBasedStateMachine):
    """A cache over a :class:`FaultyStore`, one caller, against ``model`` and ``unknown``."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-faults-"))
        self.inner = SwapStore(self.dir / "s", mode="w", durable=False, chunk_bytes="8KiB")
        self.store = FaultyStore(self.inner)
        self.model: dict[str, torch.Tensor] = {}  # keys whose value is certain
        self.unknown: dict[str, list[Value]] = {}  # keys that hold one of these values
        self.reported: set[int] = set()  # ids of the injected faults some call raised
        self.cache: TierCache | None = None
        self.counter = 0

    @initialize(
        device_pages=st.integers(0, 3),
        host_pages=st.integers(1, 4),
        policy=st.sampled_from(["lru", "lookahead"]),
        stored=st.lists(st.one_of(st.none(), LENGTHS), min_size=len(NAMES), max_size=len(NAMES)),
    )
    def start(
        self, device_pages: int, host_pages: int, policy: str, stored: list[int | None]
    ) -> None:
        """A cache over a store that holds some keys already (reads from the first step)."""
        for key, length in zip(NAMES, stored, strict=True):
            if length is not None:
                self.model[key] = torch.arange(length, dtype=torch.float32) - length
                self.inner.put(key, self.model[key])
        self.budgets = {"device": device_pages * PAGE, "host": host_pages * PAGE}
        self.cache = TierCache(
            self.store,
            device_budget=self.budgets["device"],
            host_budget=self.budgets["host"],
            policy=policy,
        )

    # ------------------------------------------------------------ calls and their faults
    def _call(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, fault)`` when the call raised an injected fault.

        Any other error fails the test; so does a fault raised twice.
        """
        try:
            return True, call()
        except OSError as exc:
            self._reported(exc)
            return False, exc

    def _reported(self, exc: OSError) -> None:
        if not isinstance(exc, InjectedFault):
            raise exc  # a real error, or the cache turned the fault into another one
        assert any(exc is fault for fault in self.store.fired), exc
        assert id(exc) not in self.reported, f"{exc} was raised twice"
        self.reported.add(id(exc))
        event(f"a call raised an injected {exc.kind} failure ({exc.mode})")

    def _retry(self, call: Callable[[], Any]) -> Any:
        """``call()`` with no fault armed; faults already under way may still surface, each
        once. A call that never succeeds has left something behind."""
        self.store.disarm()
        for _ in range(3):
            ok, result = self._call(call)
            if ok:
                return result
        raise AssertionError("a call kept failing after the faults were disarmed")

    def _check_all(self) -> None:
        """After a failure: every key reads back as the model says (faults disarmed)."""
        assert self.cache is not None
        for key in NAMES:
            candidates = self._candidates(key)
            if candidates == [None]:
                assert key not in self.cache, key
                continue
            if not all(v is not None and self._fits(v.numel() * 4, None) for v in candidates):
                continue  # the cache cannot hold it: covered by the get rule and the store checks
            got = self._retry(lambda key=key: self.cache.get(key))  # type: ignore[union-attr]
            assert _one_of(got.cpu(), candidates), f"{key!r} changed after a failed call"

    def _arm(self, fault: Fault) -> None:
        """Make the next read or write fail. One failed background write at a time: the cache
        reports the first of several. (Not a precondition: whether a delayed write has failed
        yet depends on the threads, and the rules Hypothesis may draw must not.)"""
        if fault is None:
            return
        kind, _ = fault
        if kind == "read" or (self.store.write_fault is None and not self._unreported_writes()):
            self.store.arm(*fault)

    def _unreported_writes(self) -> list[InjectedFault]:
        return [f for f in self.store.fired if f.kind == "write" and id(f) not in self.reported]

    def _candidates(self, key: str) -> list[Value]:
        if key in self.unknown:
            return self.unknown[key]
        return [self.model.get(key)]

    def _fits(self, nbytes: int, tier: str | None) -> bool:
        size = footprint(nbytes)
        if tier is None:
            return any(b > 0 and size <= b for b in self.budgets.values())
        return self.budgets[tier] > 0 and size <= self.budgets[tier]

    def _set(self, key: str, value: Value) -> None:
        self.unknown.pop(key, None)
        self.model.pop(key, None)
        if value is not None:
            self.model[key] = value

    # ------------------------------------------------------------ rules: the cache's API
    @rule(
        key=KEYS,
        length=LENGTHS,
        tier=st.sampled_from([None, "host", "device", "nvme"]),
        again=st.booleans(),
        fault=FAULTS,
    )
    def put(self, key: str, length: int, tier: str | None, again: bool, fault: Fault) -> None:
        assert self.cache is not None
        self._arm(fault)
        self.counter += 1
        value = torch.arange(length, dtype=torch.float32) + 10_000 * self.counter
        if tier in ("host", "device") and not self._fits(length * 4, tier):
            try:
                self.cache.put(key, value, tier=tier)
            except BudgetError:
                return
            raise AssertionError("a put larger than its tier did not raise BudgetError")
        ok, raised = self._call(lambda: self.cache.put(key, value, tier=tier))
        if ok:
            self._set(key, value.clone())
            return
        if raised.kind == "write-through" and raised.mode == "late":
            # the new value reached the store, then the put failed: either value may stay
            event("a write-through failed after its data landed: the key is unknown")
            self.unknown[key] = [*self._candidates(key), value.clone()]
            self.model.pop(key, None)
        self._check_all()
        if again:  # a later call works
            self._retry(lambda: self.cache.put(key, value, tier=tier))
            self._set(key, value.clone())

    @rule(key=KEYS, tier=TIERS, fault=FAULTS, cold=st.booleans())
    def get(self, key: str, tier: str | None, fault: Fault, cold: bool) -> None:
        """``cold``: evicted first, so that the get reads the store (and meets a read fault)."""
        assert self.cache is not None
        if cold:
            self.evict(key, None)
        self._arm(fault)
        candidates = self._candidates(key)
        sizes = {v.numel() * 4 for v in candidates if v is not None}
        try:
            ok, got = self._call(lambda: self.cache.get(key, tier=tier))
            if not ok:
                self._check_all()
                got = self._retry(lambda: self.cache.get(key, tier=tier))
        except KeyNotFoundError:
            assert None in candidates, f"get({key!r}) raised KeyNotFoundError"
            return
        except BudgetError:
            assert any(not self._fits(n, tier) for n in sizes), f"get({key!r}) BudgetError"
            return
        assert _one_of(got.cpu(), candidates), f"get({key!r}) returned another value"
        if key in self.unknown:  # settled for now, but a write-back may change the store
            return
        assert self._fits(got.numel() * 4, tier)

    @rule(key=KEYS, tier=TIERS, fault=FAULTS)
    def modify_in_place(self, key: str, tier: str | None, fault: Fault) -> None:
        assert self.cache is not None
        self._arm(fault)
        if key not in self.model or not self._fits(self.model[key].numel() * 4, tier):
            return

        def modify() -> None:
            with self.cache.pinned(key, tier=tier) as t:  # type: ignore[union-attr]
                t.add_(1)
                self.cache.mark_dirty(key)  # type: ignore[union-attr]

        ok, _ = self._call(modify)
        if ok:
            self.model[key] += 1
        else:
            self._check_all()

    @rule(keys=st.lists(KEYS, max_size=4), tier=st.sampled_from(["host", "device"]))
    def prefetch(self, keys: list[str], tier: str) -> None:
        assert self.cache is not None
        if not self.budgets[tier]:
            return
        try:
            self.cache.prefetch(keys, tier=tier)  # starts reads; never raises their failures
        except KeyNotFoundError:
            assert any(None in self._candidates(k) for k in keys)

    @rule(key=KEYS, fault=FAULTS)
    def evict(self, key: str, fault: Fault) -> None:
        assert self.cache is not None
        self._arm(fault)
        ok, _ = self._call(lambda: self.cache.evict(key))
        if not ok:
            self._check_all()
            return
        # Written down: the store holds the key's value. (A queued prefetch may read the key
        # back in at once, so the cache may hold it again, but clean.)
        stored = self.inner.get(key) if key in self.inner else None
        assert _one_of(stored, self._candidates(key)), f"evict({key!r}) did not write it down"
        with self.cache._cv:
            entry = self.cache._core.find(key)
            assert entry is None or not entry.dirty, f"{key!r} is still cached, dirty"

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        assert self.cache is not None
        try:
            self.cache.delete(key)
        except KeyNotFoundError:
            assert None in self._candidates(key), f"delete({key!r}) raised KeyNotFoundError"
        self._set(key, None)

    @rule(fault=FAULTS)
    def flush_and_check_store(self, fault: Fault) -> None:
        assert self.cache is not None
        self._arm(fault)
        ok, _ = self._call(self.cache.flush)
        if not ok:
            self._check_all()
            self._retry(self.cache.flush)
        assert not self._unreported_writes(), "a failed write-back was never reported"
        keys = set(self.inner.keys())
        assert set(self.model) <= keys <= set(self.model) | set(self.unknown)
        for key, value in self.model.items():
            assert torch.equal(self.inner.get(key), value), key
        for key, candidates in self.unknown.items():
            stored = self.inner.get(key) if key in keys else None
            assert _one_of(stored, candidates), key

    @rule()
    def settle(self) -> None:
        """Flush, then wait until no I/O is in flight: nothing may stay pending for good."""
        assert self.cache is not None
        self._retry(self.cache.flush)
        cache, deadline = self.cache, time.monotonic() + SETTLE_SECONDS
        with cache._cv:  # white-box: the books of a cache at rest
            while (
                any(t.unsettled() for t in cache._tiers.values())
                or cache._core.write_backs
                or cache._gate.pending
            ):
                assert time.monotonic() < deadline, "the cache never settled (a hang)"
                cache._cv.wait(0.01)
            for t in cache._tiers.values():
                for key in t.earmarks:
                    assert cache._core.wants(key), f"bytes earmarked for {key!r}, unwanted"

    # ------------------------------------------------------------ rules: the disk
    @rule(delay=st.sampled_from([0.0, 0.0, 0.001, 0.003]))
    def slow_disk(self, delay: float) -> None:
        self.store.delay = delay

    @rule(fault=FAULTS)
    def fail_later(self, fault: Fault) -> None:
        """Arm a fault for whatever I/O comes next: a prefetch, a read-ahead, a write-back."""
        self._arm(fault)

    # ------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self) -> None:
        if self.cache is None:
            return
        lock = self.cache._gate.lock
        assert not lock._is_owned(), "a call returned holding the cache's lock"  # type: ignore[attr-defined]
        assert lock.acquire(timeout=SETTLE_SECONDS), "another thread holds the cache's lock"
        try:  # white-box: each ledger's count matches what the tiers hold
            core = self.cache._core
            assert not core.blocked, "a caller is still registered as blocked"
            assert not core._demand_keys, "a caller is still registered as waiting for room"
            assert_books_balance(self.cache, self.budgets)
            for tier in self.cache._tiers.values():
                assert tier.demand_waiting == 0
                for entry in tier.entries.values():
                    assert not entry.claims, f"{entry.key!r} is still claimed"
                    assert not entry.pinners, f"{entry.key!r} is still pinned"
        finally:
            lock.release()

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.store.disarm()
                try:
                    self.cache.close()
                except OSError as exc:  # close() flushes: it may report a failed write-back
                    self._reported(exc)
                assert self.cache._gate.closed
                assert not any(t.ledger.used for t in self.cache._tiers.values())
        finally:
            self.inner.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def _one_of(got: torch.Tensor | None, candidates: list[Value]) -> bool:
    """Whether ``got`` is bit-exactly one of ``candidates`` (``None``: absent)."""
    return any(
        (got is None and c is None)
        or (got is not None and c is not None and got.shape == c.shape and torch.equal(got, c))
        for c in candidates
    )


FaultyCacheMachine.TestCase.settings = threaded_settings(max_examples=150, steps=40)
TestFaultyCacheMachine = FaultyCacheMachine.TestCase
