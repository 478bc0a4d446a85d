"""The store's concurrency gate: shared and exclusive sections over one lock.

Every :class:`~tierswap.store.SwapStore` operation passes through one :class:`Gate`; this module
is the one place its concurrency rule lives (see :class:`Gate`). What an operation registers on
entry (a key being put, the chunks a region write replaces, a read of an entry) is a
:class:`Claim`: the gate takes it when the section is entered and gives it back when the section
is left, on every path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

__all__ = ["Claim", "Gate", "Section"]

T = TypeVar("T")


class Claim(Protocol):
    """What one shared section registers; the gate calls these, in this order."""

    def busy(self) -> bool:
        """Whether the section must wait still (called with the lock held; may raise)."""
        ...

    def take(self) -> None:
        """Register the operation (lock held); raising here enters nothing."""
        ...

    def give_back(self) -> None:
        """Undo :meth:`take` (lock held); called exactly once per successful take."""
        ...

    def settle(self) -> None:
        """Work left for after the lock is released (e.g. deleting files no read uses)."""
        ...


class Gate:
    """Orders the operations of one store: any number of shared sections, or one exclusive.

    The rule:

    - A **shared** section (a put, get, region operation, delete, ``info`` or verify) runs
      together with any other shared sections.
    - An **exclusive** section (commit, close, the listing step of a snapshot) runs alone: it
      waits for the exclusive section before it, then holds every new section back, waits
      for the shared sections in flight to leave, runs, and lets the waiting ones in.
    - Entering a shared section waits out an exclusive one, then, with the lock released
      while it waits, until its claim is no longer :meth:`~Claim.busy` (e.g. the key's put in
      flight has ended); every wait ends with ``check_open`` called again, so an operation
      never starts on a store closed (or broken) while it waited.
    - The claim is taken in the same critical section as the last check, so no other
      operation sees the state between them.
    - A section entered is left exactly once, on every path: at the end of its ``with`` block
      (an exception included), or, for an operation still in flight there, when the future
      handed to :meth:`Section.finish` is done. Leaving gives the claim back and wakes every
      waiter.
    - A short shared operation may instead run entirely under the lock
      (``locked(busy)``): it waits the same way and changes the state before the lock is
      released, so it needs no claim.
    - State the claims guard is read and changed only under the lock: inside :meth:`locked`
      or inside a claim's methods.
    """

    def __init__(self, check_open: Callable[[], None]) -> None:
        self._check_open = check_open
        self._cv = threading.Condition()
        self._active = 0  # shared sections entered and not yet left
        self._exclusive = False  # an exclusive section runs or waits for the shared ones

    @contextlib.contextmanager
    def locked(self, busy: Callable[[], bool] | None = None) -> Iterator[None]:
        """The gate's lock, held: for reading or changing the state the claims guard.

        With ``busy`` the block is a shared section run entirely under the lock (for short
        bookkeeping such as ``delete``): entered like :meth:`shared`, once no exclusive
        section runs and ``busy()`` is false; it needs no claim, since nothing else runs
        between its check and its change.
        """
        with self._cv:
            if busy is not None:
                self._wait(busy)
            yield

    @contextlib.contextmanager
    def shared(self, claim: Claim) -> Iterator[Section]:
        """Enter a shared section holding ``claim`` (see the rule above); the block runs
        without the lock. The section is left when the block ends, unless the block handed
        it to :meth:`Section.finish`."""
        with self._cv:
            self._wait(claim.busy)
            claim.take()
            self._active += 1
        section = Section(self._leave, claim)
        try:
            yield section
        finally:
            if not section.kept:
                section.leave()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run the block alone: after the exclusive section before it and every shared
        section in flight, with new ones held back until it ends."""
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
        try:  # from here on, whatever happens (an interrupted wait too) lets the others in
            with self._cv:
                while self._active:
                    self._cv.wait()
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()

    def _wait(self, busy: Callable[[], bool]) -> None:
        """Wait (lock held) out an exclusive section, then until ``busy()`` is false."""
        while True:
            while self._exclusive:
                self._cv.wait()
            self._check_open()
            if not busy():
                return
            self._cv.wait()

    def _leave(self, claim: Claim) -> None:
        with self._cv:
            claim.give_back()
            self._active -= 1
            self._cv.notify_all()
        claim.settle()


class Section:
    """One entered shared section (made by :meth:`Gate.shared`)."""

    def __init__(self, leave: Callable[[Claim], None], claim: Claim) -> None:
        self._leave = leave  # the gate's: gives the claim back under its lock
        self.claim = claim
        self.kept = False  # left by a finish() callback, not by the with block
        self._left = False
        self._lock = threading.Lock()

    def leave(self) -> None:
        """Leave the section (give its claim back); a second call does nothing."""
        with self._lock:
            if self._left:
                return
            self._left = True
        self._leave(self.claim)

    def finish(self, done: Future[Any], then: Callable[[Future[Any]], T]) -> Future[T]:
        """Keep the section open until ``done`` ends, then run ``then(done)``, leave, and
        complete the returned future with ``then``'s result or error (in that order: the
        section is left before the caller sees the result)."""
        self.kept = True
        result: Future[T] = Future()

        def _done(finished: Future[Any]) -> None:
            try:
                value = then(finished)
            except BaseException as exc:
                self.leave()
                result.set_exception(exc)
                return
            self.leave()
            result.set_result(value)

        done.add_done_callback(_done)
        return result

    def finish_with(self, done: Future[Any], value: T) -> Future[T]:
        """:meth:`finish` with ``value`` as the result once ``done`` succeeded (a read's
        ``out``); ``done``'s error otherwise."""

        def then(finished: Future[Any]) -> T:
            finished.result()
            return value

        return self.finish(done, then)
