"""A pipeline's write-behinds: the writes in flight, the ones still waiting for their bytes
to come back from the device, and the errors they ended with.

Private to :mod:`tierswap.pipeline`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from tierswap.pipeline._jobs import Region, RegionStore, overlap, write_regions

__all__ = ["WriteBehind"]


class WriteBehind:
    """The write-behinds of one pipeline, started in order, ended on the store's threads.

    ``cv`` is the pipeline's condition: :attr:`in_flight` is read under it, and the end of a
    write is recorded under it before the caller's ``then`` runs (which notifies waiters).
    A write that fails is kept and raised by :meth:`raise_errors`, once. :meth:`start`,
    :meth:`unsent_to`, :meth:`wait` and :meth:`raise_errors` are called from one thread (the
    pipeline's caller).
    """

    def __init__(self, store: RegionStore, cv: threading.Condition) -> None:
        self._store, self._cv = store, cv
        self._futures: list[Future[Any]] = []
        # writes waiting for their copies back from the device: their regions, by the future
        # of the moment they are handed to the store
        self._unsent: dict[Future[None], tuple[Region, ...]] = {}
        self._errors: list[BaseException] = []

    @property
    def in_flight(self) -> bool:
        """Whether any write has not ended. The caller holds the condition."""
        return bool(self._futures)

    def start(
        self, landed: Future[Any], writes: dict[Region, torch.Tensor], then: Callable[[], None]
    ) -> None:
        """Write ``writes`` once ``landed`` completes, and call ``then`` when they have ended
        (failed or not). A write that cannot start now raises here, with nothing recorded."""
        done = self._write_when(landed, writes)
        with self._cv:
            self._futures.append(done)
        done.add_done_callback(lambda f: self._ended(f, then))

    def _ended(self, done: Future[Any], then: Callable[[], None]) -> None:
        error = done.exception()
        with self._cv:
            if error is not None:
                self._errors.append(error)
            if done in self._futures:
                self._futures.remove(done)
        then()

    def _write_when(self, landed: Future[Any], writes: dict[Region, torch.Tensor]) -> Future[Any]:
        """Start writing ``writes`` once ``landed`` completes: at once when it has (a failure
        to start then raises here), else on the thread that completes it, so the wait for a
        copy back from the device never happens on the caller's thread."""
        if landed.done():
            landed.result()
            return write_regions(self._store, writes)
        done: Future[Any] = Future()
        handed: Future[None] = Future()  # the writes are the store's: it orders reads after them
        with self._cv:
            self._unsent[handed] = tuple(writes)

        def start(copied: Future[Any]) -> None:
            try:
                copied.result()
                written = write_regions(self._store, writes)
            except BaseException as exc:
                done.set_exception(exc)
                return
            finally:
                with self._cv:
                    del self._unsent[handed]
                handed.set_result(None)
            written.add_done_callback(lambda w: _settle(done, w))

        landed.add_done_callback(start)
        return done

    def unsent_to(self, reads: Iterable[Region]) -> list[Future[None]]:
        """Hand-overs to the store still to come of writes that overlap ``reads`` (a read
        started before would read the bytes those writes replace)."""
        wanted = tuple(reads)
        with self._cv:
            return [
                handed
                for handed, regions in self._unsent.items()
                if any(overlap(a, b) for a in regions for b in wanted)
            ]

    def wait(self) -> None:
        """Wait until every write started (also those started meanwhile) has ended."""
        while True:
            with self._cv:
                pending = list(self._futures)
            if not pending:
                return
            for future in pending:
                future.exception()

    def raise_errors(self) -> None:
        """Raise the first write failure not raised yet (and forget the others)."""
        with self._cv:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


def _settle(target: Future[Any], source: Future[Any]) -> None:
    """Complete ``target`` as ``source`` completed."""
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
