"""The pipeline's device side: jobs' tensors copied to the device for their work, their
results copied back, and jobs kept in the device tier after their first pass.

Private to :mod:`tierswap.pipeline`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch

from tierswap.engine import (
    DeviceStaging,
    Ledger,
    Region,
    ResidentSet,
    Staged,
    Transfers,
    nbytes_of,
    to_host_all,
)
from tierswap.pipeline._jobs import Job
from tierswap.tiers import DEVICE, HOST, TierName

__all__ = ["DeviceSide"]

Tensors = dict[Region, torch.Tensor]


class DeviceSide:
    """How a pipeline's jobs meet the device through ``transfers``: :attr:`staging` copies
    a job's tensors there for its work (``work_on_device``, where the transfers move bytes)
    and its results back; :meth:`keep` makes a job resident in the device tier (``books``,
    the pipeline's resident jobs by tier, on ``ledgers``). Without a GPU the device tier is
    host memory, and nothing is copied. Called under the pipeline's rules (one caller
    thread; the ledgers under its condition ``cv``)."""

    def __init__(
        self,
        transfers: Transfers,
        ledgers: dict[TierName, Ledger],
        books: dict[TierName, ResidentSet[Hashable, Tensors]],
        cv: threading.Condition,
        *,
        work_on_device: bool,
    ) -> None:
        self.transfers = transfers
        # copies to the device: of jobs kept there, and with work_on_device of every job's
        # tensors for its work (else the work gets host tensors, or resident device ones)
        self.staging: DeviceStaging[Region] = DeviceStaging(transfers, ledgers[DEVICE])
        self.work_on_device = work_on_device and transfers.moves
        self._ledgers, self._books, self._cv = ledgers, books, cv

    def staging_for(self, tier: TierName | None) -> DeviceStaging[Region] | None:
        """What copies the tensors of a job resident in ``tier`` (``None``: streamed) to the
        device for its work; ``None`` when the work gets them as they are (no work on the
        device, or a job resident there)."""
        if not self.work_on_device or tier == DEVICE:
            return None
        return self.staging

    def copy_out(
        self, host: Tensors, staged: Staged[Region] | None, writes: Tensors
    ) -> tuple[Tensors, Future[Any]]:
        """The host tensors to write for ``writes`` (copied into ``host``'s buffers of the same
        regions when they are elsewhere) and the future of the moment they hold the bytes and
        no copy of the job reads its host buffers any more."""
        on_host, landed = to_host_all(self.transfers, host, writes)
        if staged is not None:
            landed = self.staging.finished(staged, landed, nbytes_of(writes))
        return on_host, landed

    def keep(
        self,
        job: Job,
        tensors: Tensors,
        staged: Staged[Region] | None,
        writes: Tensors,
        *,
        give_back: Callable[[], None],
    ) -> bool:
        """Make ``job`` (its host ``tensors`` and the results ``writes`` of its first pass)
        resident in the device tier; ``False`` when that tier has no room for it (it then
        streams, as any other job). ``give_back`` returns its host buffers to the pool, once
        the copies have read them."""
        name, nbytes = job.name, job.nbytes
        device, host, merged = self._ledgers[DEVICE], self._ledgers[HOST], {**tensors, **writes}
        if staged is None and not self.transfers.moves:  # a device tier in host memory
            if not device.try_reserve(nbytes):
                return False
            self._books[DEVICE].keep(name, merged, nbytes)  # the same buffers, which leave
            with self._cv:  # the host's books
                host.release(nbytes)
                device.count_moved(into=nbytes_of(merged))
                host.count_moved(out=nbytes_of(merged))
            return True
        if staged is None:
            staged = self.staging.copy_in(nbytes, merged, wait=False)
            if staged is None:
                return False
            host.count_moved(out=nbytes_of(merged))
            kept = self.staging.ready(staged)
        else:  # on the device already, its bytes reserved there: they stay if the device
            with self._cv:  # still has room for the work of one more job
                if device.free < nbytes:
                    return False
            kept = {region: copy.device_tensor for region, copy in staged.copies.items()}
        self._books[DEVICE].keep(name, {**kept, **writes}, nbytes)
        staged.read.add_done_callback(lambda _: give_back())
        return True
