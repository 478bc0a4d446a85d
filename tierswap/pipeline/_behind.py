"""Work the pipeline runs behind its caller: a flush and what must follow it (a commit), on a
thread of its own, which every later call of the pipeline waits for.

Private to :mod:`tierswap.pipeline`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["Behind", "Ended", "settled_first"]

T = TypeVar("T")
P = ParamSpec("P")


class _Settles(Protocol):
    def settle(self) -> None: ...


S = TypeVar("S", bound=_Settles)


def settled_first(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """``method``, which first calls its object's ``settle()`` (waits for the work behind)."""

    @functools.wraps(method)
    def settled(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        self.settle()
        return method(self, *args, **kwargs)

    return settled


#: Called on the settling thread with the work's failure (``None``: it succeeded) and the
#: ``time.monotonic()`` at which it ended.
Ended = Callable[[BaseException | None, float], None]


class Behind:
    """At most one piece of work in flight behind the pipeline's caller (:meth:`start`), and
    the bookkeeping its end calls for, done by the caller when it next calls the pipeline
    (:meth:`settle`).

    Concurrency: :meth:`start` and :meth:`settle` are called under the pipeline's rule (one
    caller thread at a time), and a lock makes each work's end settle once even if two threads
    settle at once; the work runs on a thread started for it, which touches nothing of the
    pipeline's but what the work itself does; ``ended`` runs on the settling thread. A failure
    is raised once, by the next :meth:`settle`.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # held by the settle that waits, so ``ended`` runs once
        self._future: Future[Any] | None = None
        self._ended: Ended = lambda error, at: None
        self._at = 0.0  # when the work ended (set on its thread before its future is done)

    def start(self, work: Callable[[], T], ended: Ended) -> Future[T]:
        """Run ``work`` on a thread of its own (``"tierswap-behind"``) and return its future;
        the next :meth:`settle` waits for it and calls ``ended``. Settles the work before
        first."""
        self.settle()
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                result = work()
            except BaseException as exc:
                self._at = time.monotonic()
                future.set_exception(exc)
            else:
                self._at = time.monotonic()
                future.set_result(result)

        with self._lock:
            # a daemon: an interpreter that exits without closing the pipeline's owner drops
            # the work as a crash would (the store keeps its last commit); owners close at exit
            threading.Thread(target=run, name="tierswap-behind", daemon=True).start()
            self._future, self._ended = future, ended  # (a thread that did not start: none)
        return future

    def settle(self) -> None:
        """Wait for the work in flight, if any, and call its ``ended``; raise its failure
        (once)."""
        if self._future is None:  # the common case: nothing behind, no lock taken
            return
        with self._lock:
            future, ended = self._future, self._ended
            if future is None:
                return
            error = future.exception()  # waits
            self._future, self._ended = None, lambda error, at: None
            try:
                ended(error, self._at)
            finally:
                if error is not None:
                    raise error
