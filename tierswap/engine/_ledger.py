"""The byte ledger of one memory tier: every byte a front end holds there, reserved first.

Private to :mod:`tierswap.engine`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from tierswap.config import format_size
from tierswap.engine.stats import TierStats
from tierswap.errors import BudgetError

__all__ = ["Ledger"]


class Ledger:
    """Used and free bytes of one tier (device or host) under a hard budget.

    **Invariant**: ``0 <= used <= budget``, checked on every change. A front end reserves a
    buffer's bytes before it allocates it (a read's destination, a resident tensor, a transient
    copy for a write) and releases them once it is freed or idle in a pool (idle pooled buffers are
    memory too, kept within the room left). So the tier's memory stays within its budget, whatever
    the disk's speed. The ledger also owns the counters of what the tier serves: ``hits`` /
    ``misses`` (:meth:`count_use`) and ``bytes_in`` / ``bytes_out`` (:meth:`count_moved`).

    Thread safety: every method takes ``cv``, the front end's own condition, so that its state and
    its ledgers change under one lock (and :meth:`reserve` wakes on what the front end notifies)."""

    def __init__(self, name: str, budget: int, cv: threading.Condition | None = None) -> None:
        if budget < 0:
            raise BudgetError(f"the {name} budget is {budget} bytes; it must be >= 0")
        self.name = name
        self.budget = budget
        self.cv = cv if cv is not None else threading.Condition()
        self.used = 0
        self.peak = 0
        self.hits = self.misses = 0
        self.bytes_in = self.bytes_out = 0

    @property
    def free(self) -> int:
        return self.budget - self.used

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they are free now; never waits."""
        with self.cv:
            if self.used + nbytes > self.budget:
                return False
            self._change(nbytes)
            return True

    def reserve(self, nbytes: int, *, can_wait: Callable[[], bool]) -> None:
        """Reserve ``nbytes``, waiting while they are not free and ``can_wait()`` says that
        something in flight will free bytes. Raises :class:`BudgetError` when they can never
        come (more than the budget, or nothing left to wait for)."""
        if nbytes > self.budget:
            raise BudgetError(
                f"{format_size(nbytes)} ({nbytes} bytes) cannot fit the {self.name} budget of "
                f"{format_size(self.budget)}; raise the budget"
            )
        with self.cv:
            while self.used + nbytes > self.budget:
                if not can_wait():
                    raise BudgetError(
                        f"{format_size(nbytes)} do not fit beside the {format_size(self.used)} "
                        f"held in the {self.name} tier (budget {format_size(self.budget)}), and "
                        "nothing in flight will free them; raise the budget"
                    )
                self.cv.wait()
            self._change(nbytes)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved before; wakes waiters."""
        with self.cv:
            self._change(-nbytes)
            self.cv.notify_all()

    def count_use(self, *, hit: bool) -> None:
        """A use of data at this tier: found here (``hit``), or brought in."""
        with self.cv:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def count_moved(self, *, into: int = 0, out: int = 0) -> None:
        """Bytes moved into this tier (read from below, copied from the other tier) and out
        of it (written down, copied to the other tier)."""
        with self.cv:
            self.bytes_in += into
            self.bytes_out += out

    def _change(self, delta: int) -> None:
        used = self.used + delta
        if not 0 <= used <= self.budget:
            raise AssertionError(
                f"{self.name} ledger: {self.used} + {delta} leaves [0, {self.budget}]"
            )
        self.used = used
        self.peak = max(self.peak, used)

    def stats(self) -> TierStats:
        """What the tier holds and served, now (the stats' fields are the ledger's own)."""
        with self.cv:
            return TierStats(
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(TierStats)}
            )
