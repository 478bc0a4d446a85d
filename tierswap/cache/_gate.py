"""The one lock of a tier cache, and the store calls that run outside it.

Private to :mod:`tierswap.cache`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tierswap.errors import StoreClosedError


class Gate:
    """The cache's lock, its deferred store calls, and the pump thread that plans prefetches.

    All of a cache's state changes only while ``cv`` is held. Store calls that start I/O or look
    up metadata are never made under it: :meth:`defer` queues them, and they run with the lock
    released, by the calling thread on its way out (:meth:`drain`), by a caller about to wait
    (:meth:`wait`) or by the pump. I/O completions take the lock, update state and :meth:`wake`
    the pump, which plans the prefetches the freed bytes allow. The lock is reentrant only for
    the engine's ledgers, which share ``cv``; the cache takes it once per call, so the one
    release in :meth:`run_deferred` frees it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.closed = False
        self.stall_seconds = 0.0  # time callers (not the pump) spent waiting here
        self._launches: list[Callable[[], None]] = []
        self._pump_wanted = False
        self._pump: threading.Thread | None = None

    def start(self, plan: Callable[[], None]) -> None:
        """Start the pump thread: it calls ``plan()`` under the lock after each :meth:`wake`."""
        self._pump = threading.Thread(
            target=self._pump_loop, args=(plan,), name="tierswap-cache", daemon=True
        )
        self._pump.start()

    # ------------------------------------------------------------ under the lock
    def defer(self, launch: Callable[[], None]) -> None:
        """Run ``launch`` once the lock is released (it may take the lock itself)."""
        self._launches.append(launch)

    @property
    def pending(self) -> bool:
        """Whether deferred calls are queued (something about to start may free bytes)."""
        return bool(self._launches)

    def wait(self, timeout: float | None = None) -> None:
        """Run the deferred calls (lock released meanwhile), or wait for a state change. Time spent
        here by a caller (not the pump thread) counts as stall."""
        start = time.perf_counter()
        if self._launches:
            self.run_deferred()
        else:
            self.cv.wait(timeout)
        if threading.current_thread() is not self._pump:
            self.stall_seconds += time.perf_counter() - start

    def run_deferred(self) -> None:
        """Run the deferred calls with the lock released; hold it again after."""
        launches, self._launches = self._launches, []
        self.lock.release()
        try:
            for launch in launches:
                launch()
        finally:
            self.lock.acquire()

    def wake(self) -> None:
        """Ask the pump to plan prefetches again, and wake every waiter."""
        self._pump_wanted = True
        self.cv.notify_all()

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("the TierCache is closed; make a new one")

    def close(self) -> None:
        """Mark the cache closed and stop the pump (it exits once the lock is released)."""
        self.closed = True
        self.cv.notify_all()

    # ------------------------------------------------------------ lock not held
    def drain(self) -> None:
        """Run the calls deferred by the call that just released the lock."""
        with self.cv:
            if self._launches:
                self.run_deferred()

    def join(self) -> None:
        """Wait for the pump thread to exit (after :meth:`close`)."""
        if self._pump is not None:
            self._pump.join()

    def _pump_loop(self, plan: Callable[[], None]) -> None:
        with self.cv:
            while not self.closed:
                if self._pump_wanted:
                    self._pump_wanted = False
                    plan()
                    self.run_deferred()
                else:
                    self.cv.wait()
