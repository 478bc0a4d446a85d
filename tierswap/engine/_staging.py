"""Work on the device: a front end's jobs copied in and their results copied back, within the
device ledger.

Private to :mod:`tierswap.engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

from tierswap.engine._disk import nbytes_of
from tierswap.engine._ledger import Ledger
from tierswap.engine.transfer import ToDevice, Transfers
from tierswap.io import gather

__all__ = ["DeviceStaging", "Staged"]

K = TypeVar("K", bound=Hashable)


@dataclasses.dataclass
class Staged(Generic[K]):
    """One job's host tensors on their way to the device: the copies, the device bytes reserved
    for them, and a future that completes when every copy has read its host buffer."""

    copies: dict[K, ToDevice]
    nbytes: int
    read: Future[Any]


class DeviceStaging(Generic[K]):
    """Copies jobs' tensors to the device for their work and their results back to the host.

    A job on the device holds its bytes in the device ``ledger`` from its copy in until its
    results have landed in host memory (or, kept resident there, until the front end releases
    them). Copies issued ahead (:meth:`ahead`) wait, by job name, for the job to be taken;
    results copied back into a host-resident job's tensors are *landing* until their copies
    complete, and its next use waits for them (:meth:`wait_landing`). Called from the front end's
    thread; copy completions (any thread) only release device bytes, under ``ledger.cv``."""

    def __init__(self, transfers: Transfers, ledger: Ledger) -> None:
        self.transfers = transfers
        self._ledger = ledger
        self._ahead: dict[Hashable, Staged[K]] = {}
        self._landing: dict[Hashable, Future[Any]] = {}
        self._pending = 0  # device reservations that a copy still in flight will release

    # ------------------------------------------------------------------ in
    def copy_in(
        self, nbytes: int, host_tensors: Mapping[K, torch.Tensor], *, wait: bool
    ) -> Staged[K] | None:
        """Reserve ``nbytes`` in the device ledger and start copying ``host_tensors`` in.
        ``wait``: wait while results in flight will free device bytes (``BudgetError`` when
        nothing will); else ``None`` at once when there is no room."""
        if wait:
            self._ledger.reserve(nbytes, can_wait=lambda: self._pending > 0)
        elif not self._ledger.try_reserve(nbytes):
            return None
        try:
            copies = {key: self.transfers.to_device(t) for key, t in host_tensors.items()}
        except BaseException:
            self._ledger.release(nbytes)
            raise
        with self._ledger.cv:
            self._ledger.count_moved(into=nbytes_of(host_tensors))
        return Staged(copies, nbytes, gather([c.done for c in copies.values()]))

    def ahead(self, name: Hashable, nbytes: int, host_tensors: Mapping[K, torch.Tensor]) -> None:
        """Copy job ``name`` in now, before it is taken, when the device has room for it."""
        if name in self._ahead:
            return
        staged = self.copy_in(nbytes, host_tensors, wait=False)
        if staged is not None:
            self._ahead[name] = staged

    def for_work(
        self, name: Hashable, nbytes: int, host_tensors: Mapping[K, torch.Tensor]
    ) -> Staged[K]:
        """Job ``name``'s copies for its work: those issued ahead, else issued now (after its
        last results have landed in ``host_tensors``, waiting for device room)."""
        staged = self._ahead.pop(name, None)
        if staged is None:
            self.wait_landing(name)
            staged = self.copy_in(nbytes, host_tensors, wait=True)
            assert staged is not None  # copy_in waited for room or raised
        return staged

    def ready(self, staged: Staged[K]) -> dict[K, torch.Tensor]:
        """The device tensors of ``staged``, each waited for by the work's stream."""
        return {key: self.transfers.ready(copy) for key, copy in staged.copies.items()}

    def drop(self, name: Hashable) -> None:
        """Drop the copies issued ahead for job ``name``, which will not work now."""
        staged = self._ahead.pop(name, None)
        if staged is not None:
            self.abandon(staged)

    def drop_all(self) -> None:
        for name in list(self._ahead):
            self.drop(name)

    def abandon(self, staged: Staged[K]) -> None:
        """Give up ``staged`` (its work failed, or will not run): its device bytes go back once
        its copies have read the host buffers, which the caller may then reuse."""
        staged.read.exception()  # wait: the copies read the host buffers
        self._ledger.release(staged.nbytes)

    # ------------------------------------------------------------------ out
    def finished(self, staged: Staged[K], landed: Future[Any], moved: int) -> Future[Any]:
        """After a job's work: release its device bytes once its copies in and its results'
        copies out (``landed``, ``moved`` bytes) have all finished; the future of that."""
        done = gather([staged.read, landed])
        with self._ledger.cv:
            self._pending += 1
            self._ledger.count_moved(out=moved)

        def release(_: Future[Any]) -> None:
            # the device tensors go with their bytes (this closure outlives the call: the
            # future keeps it, and a write waiting for the future keeps that)
            staged.copies.clear()
            with self._ledger.cv:  # one section: a waiter never sees neither pending nor freed
                self._pending -= 1
                self._ledger.release(staged.nbytes)

        done.add_done_callback(release)
        return done

    # ------------------------------------------------------------------ host-resident results
    def land(self, name: Hashable, landed: Future[Any]) -> None:
        """Job ``name``'s host-resident tensors hold its results once ``landed`` completes."""
        if not landed.done():
            self._landing[name] = landed

    def landed(self, name: Hashable) -> bool:
        """Whether job ``name`` has no results still landing (checked without waiting)."""
        landing = self._landing.get(name)
        return landing is None or landing.done()

    def wait_landing(self, name: Hashable | None = None) -> None:
        """Wait until job ``name``'s results (every job's: ``None``) have landed."""
        names = list(self._landing) if name is None else [name]
        for each in names:
            landing = self._landing.pop(each, None)
            if landing is not None:
                landing.result()
