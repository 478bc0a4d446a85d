"""How :class:`Pipeline` streams jobs: read ahead, work, write behind, within byte budgets.

A cyclic workload over data larger than memory (an optimizer step) is a list of :class:`Job` s,
each naming the :class:`Region` s of stored tensors it needs. :meth:`Pipeline.run` moves every
job through three stages: **read-ahead** into pooled, page-aligned host buffers as soon as the
budget has room, several jobs ahead; **work**, the caller's function on the caller's thread,
which returns the tensors to write; **write-behind**, after which the job's bytes return to the
budget while later jobs already work.

*Resident* jobs (``Job.tier``, chosen by the policy on the cyclic schedule:
:func:`tierswap.engine.place`) skip read-ahead and write-behind after their first pass: their
tensors stay in the device or host tier until :meth:`Pipeline.flush`. A *held* job
(:meth:`Pipeline.hold`) is a host-resident one without work of its own, whose tensors the
caller updates in place (e.g. the scales of 8-bit state, a page of which serves several slices).
A *lent* job (:meth:`Pipeline.lend`) is a streamed one whose read buffers outlive the call that
takes them (the source of a device copy still in flight) until the caller gives them back.

Everything moves through the engine: a :class:`~tierswap.engine.Ledger` per memory tier (idle
pooled buffers count too), one :class:`~tierswap.engine.Disk`, and, for work on the device, a
:class:`~tierswap.engine.DeviceStaging` (copies in issued during the work of the job ahead,
copies back landing before the write-behind hands them to the store).

A flush can end behind the caller (:meth:`Pipeline.flush_behind`: its writes, then a commit of
the store, on a thread of their own); every later call but the queries waits for it first.

Thread safety: the public methods are called from one thread at a time (the caller's); I/O
completions arrive on the store's threads and only touch the ledgers and the buffer pools, under
one condition variable."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from tierswap.config import Size, parse_size
from tierswap.engine import (
    CacheStats,
    Disk,
    Ledger,
    Region,
    Staged,
    StoreProtocol,
    Transfers,
    nbytes_of,
    overlap,
    to_host_all,
    transfers_for,
)
from tierswap.errors import BudgetError
from tierswap.io import footprint
from tierswap.pipeline._behind import Behind, Ended, settled_first
from tierswap.pipeline._buffers import JobBuffers
from tierswap.pipeline._device import DeviceSide
from tierswap.pipeline._jobs import Job, Work
from tierswap.pipeline._resident import ResidentJobs
from tierswap.tiers import DEVICE, HOST, TierName

__all__ = ["Pipeline"]

T = TypeVar("T")


@dataclasses.dataclass
class _Reading:
    """A job whose reads have started: its buffers and the future of all its reads."""

    job: Job
    tensors: dict[Region, torch.Tensor]
    done: Future[Any]


class Pipeline:
    """Read-ahead / work / write-behind over a :class:`~tierswap.SwapStore` within budgets.

    Parameters
    ----------
    store:
        The store holding the regions: a :class:`~tierswap.SwapStore` or any other
        :class:`~tierswap.engine.StoreProtocol`.
    budget:
        Host bytes (or a size such as ``"4GiB"``) the pipeline may hold at once: jobs resident
        in host memory, jobs read ahead, the job at work and the work buffer (``Job.scratch``),
        jobs being written back and idle pooled buffers. A job larger than the budget raises
        ``BudgetError``.
    device_budget:
        Bytes of the device tier: jobs resident there (``Job.tier="device"``). On a GPU
        (``device`` a CUDA device) their tensors live in device memory; without one the device
        tier is an ordinary CPU-memory tier with its own budget.
    device:
        Where device-tier tensors live (default: the CPU).
    transfers:
        How tensors move between host and ``device`` (default:
        :func:`~tierswap.engine.transfers_for` ``(device)``; tests pass a recording stand-in).
    work_on_device:
        Hand the work every job's tensors on the device and copy its results back (see above).
        Streamed jobs then pass through the device tier: ``device_budget`` must hold at least
        one job beside the resident ones, and one or two more let the copies overlap the work.
    """

    def __init__(
        self,
        store: StoreProtocol,
        budget: Size,
        *,
        device_budget: Size = 0,
        device: torch.device | None = None,
        transfers: Transfers | None = None,
        work_on_device: bool = False,
    ) -> None:
        self._store = store  # its array info; the bytes move through ``_disk``
        self.budget = parse_size(budget, name="budget")
        self._cv = threading.Condition()
        self._ledgers: dict[TierName, Ledger] = {
            DEVICE: Ledger(DEVICE, parse_size(device_budget, name="device_budget"), self._cv),
            HOST: Ledger(HOST, self.budget, self._cv),
        }
        self._device = device if device is not None else torch.device("cpu")
        self._transfers = transfers if transfers is not None else transfers_for(self._device)
        self._reading: dict[Hashable, _Reading] = {}
        self._lent = 0  # jobs lent (:meth:`lend`) and not given back yet
        self._resident = ResidentJobs(self._ledgers)
        self._kept = self._resident.books  # the resident jobs' tensors, by tier
        self._device_side = DeviceSide(
            self._transfers, self._ledgers, self._kept, self._cv, work_on_device=work_on_device
        )
        self._staging = self._device_side.staging
        self._held: dict[Hashable, Job] = {}  # the resident jobs that hold() keeps
        self._disk = Disk(store, self._cv)  # reads, write-behinds and their errors
        self._behind = Behind()  # a flush whose writes (and commit) end behind the caller
        self._buffers = JobBuffers(self._ledgers[HOST], self._cv)
        self._dtypes: dict[str, torch.dtype] = {}
        self._work_wanted = 0  # the work buffer's bytes that the jobs running now need
        #: Host bytes that reads started ahead leave free for write-behinds the caller makes
        #: meanwhile (a streamed parameter's gradients in backward): a write that found the
        #: room taken would drop a read ahead, whose bytes would then be read twice.
        self.write_room = 0
        self.stall_seconds = 0.0

    # ------------------------------------------------------------------ the three stages
    @settled_first
    def prefetch(self, jobs: Iterable[Job]) -> None:
        """Start reading ``jobs`` (in order) while the budget has room; never blocks. The work
        buffer comes first: reads started ahead would otherwise be dropped to make room for it."""
        jobs = list(jobs)
        if self._hold_work_buffer(jobs, wait=False):
            self._read_ahead(jobs)

    def _read_ahead(self, jobs: Sequence[Job]) -> None:
        """Start reading ``jobs`` (in order) while the budget has room (their work buffer
        already held)."""
        for job in jobs:
            in_memory = job.name in self._reading or self.resident_tier(job.name) is not None
            if in_memory or self._disk.unsent_to(job.reads):
                continue
            if not self._start_reads(job, wait=False):
                return

    @settled_first
    def run(self, jobs: Sequence[Job], work: Work) -> None:
        """Run every job through read-ahead, ``work`` and write-behind, in order.

        Returns once the last job's work is done; its writes may still be in flight
        (:meth:`drain` waits for them). A failed write-behind is raised here or by ``drain``.
        """
        self._hold_work_buffer(jobs, wait=True)
        for position, job in enumerate(jobs):
            self._disk.raise_errors()
            tensors = self._acquire(job)
            self._read_ahead(jobs[position + 1 :])  # the work buffer is held for all of them
            staging, staged = self._device_side.staging_for(self.resident_tier(job.name)), None
            try:
                if staging is not None:
                    staged = staging.for_work(job.name, job.nbytes, tensors)
                if position + 1 < len(jobs):
                    self._stage_ahead(jobs[position + 1])
                writes = work(job, staging.ready(staged) if staging and staged else tensors)
            except BaseException:  # its device copies go; a streamed job's buffers go back
                if staged is not None:  # once no copy reads them
                    self._staging.abandon(staged)
                if self.resident_tier(job.name) is None:
                    self._give_back(job, tensors)
                else:  # the work may have changed its tensors
                    self._resident.changed(job)
                raise
            self._finish(job, tensors, staged, writes)
            # its device tensors go now: the device ledger may already have given their bytes
            # to the next job, whose copies would else be made while these still hold them
            del staged, writes
            self._read_ahead(jobs[position + 1 :])

    def landed(self, name: Hashable) -> bool:
        """Whether job ``name`` is in memory now: resident, or read ahead and landed (:meth:`lend`
        would not wait)."""
        reading = self._reading.get(name)
        return self.resident_tier(name) is not None or (reading is not None and reading.done.done())

    @settled_first
    def lend(self, job: Job) -> tuple[dict[Region, torch.Tensor], Callable[[], None]]:
        """The tensors of ``job``, a streamed job, read (or taken from a read started ahead),
        for a caller that still uses them after this returns (the source of a copy in flight),
        and the function that gives them back (once, from any thread: their buffers go back to
        the pool, their bytes to the host budget). No work runs on them and nothing is written."""
        assert self.resident_tier(job.name) is None, job.name
        tensors = self._acquire(job)
        with self._cv:
            self._lent += 1  # room that will come back: reads wait for it (_make_room)
        return tensors, functools.partial(self._give_back_lent, job, tensors)

    def _give_back_lent(self, job: Job, tensors: dict[Region, torch.Tensor]) -> None:
        self._give_back(job, tensors)
        with self._cv:
            self._lent -= 1
            self._cv.notify_all()

    @settled_first
    def hold(self, job: Job) -> dict[Region, torch.Tensor]:
        """The tensors of ``job``'s regions, kept in host memory from this call on: read once
        (or taken from a read :meth:`prefetch` started), its ``nbytes`` reserved in the host
        budget as a host-resident job's, until :meth:`evict`; later calls return the same
        tensors. No work runs on them: the caller reads and updates them in place (between
        passes, or in the work of the jobs that :meth:`run` runs), and :meth:`flush` writes
        them. A held job of the same name with other regions is written back and let go
        first."""
        held = self._held.get(job.name)
        if held == job:
            self._ledgers[HOST].count_use(hit=True)
            return self._kept[HOST][job.name]
        if held is not None:
            self._let_go(job.name)
        tensors = self._acquire(job)
        self._kept[HOST].keep(job.name, tensors, job.nbytes)
        self._held[job.name] = job
        return tensors

    def _let_go(self, name: Hashable) -> None:
        """Write held job ``name``'s tensors back, then free them and return its bytes."""
        tensors = self._kept[HOST][name]
        del self._held[name]
        self._disk.write(tensors)
        self.drain()
        with self._cv:
            self._kept[HOST].drop(name)
        self._ledgers[HOST].count_moved(out=nbytes_of(tensors))

    def scratch(self, job: Job) -> torch.Tensor | None:
        """The work buffer for ``job``'s work while it runs (``job.scratch`` bytes or more,
        uint8, page-aligned, its contents undefined); ``None`` when it asked for none. One
        buffer serves every job, one after the other: do not keep it past the work."""
        return self._buffers.work if job.scratch > 0 else None

    def _hold_work_buffer(self, jobs: Sequence[Job], *, wait: bool) -> bool:
        """Hold a work buffer for the largest ``Job.scratch`` of ``jobs``, reserved in the
        host budget until :meth:`evict` (a larger one replaces a smaller one); whether it is
        held. ``wait``: make the room as a job's reads do, else only take room that is free
        now."""
        nbytes = max((job.scratch for job in jobs), default=0)
        if wait:
            self._work_wanted = nbytes
        if nbytes <= self._buffers.work_bytes:
            return True
        with self._cv:
            host = self._ledgers[HOST]
            if not wait and host.free + self._buffers.work_bytes < nbytes:
                return False
            self._buffers.drop_work()
            self._make_room(nbytes)
            self._buffers.hold_work(nbytes)
        return True

    def _acquire(self, job: Job) -> dict[Region, torch.Tensor]:
        """The job's tensors: resident ones at once, else its reads (started here if need be)."""
        tier = self.resident_tier(job.name)
        if tier is not None:
            self._ledgers[tier].count_use(hit=True)
            return self._kept[tier][job.name]
        started = time.perf_counter()
        stale = self._reading.get(job.name)
        if stale is not None and stale.job != job:  # read ahead for other regions: redo
            self._drop_reading(job.name)
        if job.name not in self._reading:
            self._start_reads(job, wait=True)
        reading = self._reading.pop(job.name)
        try:
            reading.done.result()
        except BaseException:
            self._give_back(job, reading.tensors)
            raise
        finally:
            self.stall_seconds += time.perf_counter() - started
        self._ledgers[HOST].count_use(hit=False)
        self._ledgers[HOST].count_moved(into=nbytes_of(reading.tensors))
        return reading.tensors

    def _finish(
        self,
        job: Job,
        tensors: dict[Region, torch.Tensor],
        staged: Staged[Region] | None,
        writes: dict[Region, torch.Tensor],
    ) -> None:
        """Keep a resident job's results (a job of the host tier stays after its first pass,
        its reserved bytes with it), or write the job back and free it when done."""
        tier = self.resident_tier(job.name)
        if tier is None and job.tier == HOST:
            self._kept[HOST].keep(job.name, tensors, job.nbytes)
            tier = HOST
        if tier == DEVICE:
            self._kept[DEVICE][job.name].update(writes)
        elif tier == HOST:  # the results land in its tensors; its next use waits for them
            resident = self._kept[HOST][job.name]
            on_host, landed = self._device_side.copy_out(resident, staged, writes)
            resident.update(on_host)
            self._staging.land(job.name, landed)
        elif not (job.tier == DEVICE and self._keep_on_device(job, tensors, staged, writes)):
            host_writes, landed = self._device_side.copy_out(tensors, staged, writes)
            self._write(host_writes, after=landed, then=lambda _: self._give_back(job, tensors))
            self._ledgers[HOST].count_moved(out=nbytes_of(host_writes))
            return
        self._resident.changed(job)  # the store has its results at a flush

    def _keep_on_device(
        self,
        job: Job,
        tensors: dict[Region, torch.Tensor],
        staged: Staged[Region] | None,
        writes: dict[Region, torch.Tensor],
    ) -> bool:
        """Make ``job`` resident in the device tier after its first pass (its host buffers go
        back to the pool once no copy reads them); ``False`` when that tier has no room."""
        give_back = functools.partial(self._give_back, job, tensors)
        return self._device_side.keep(job, tensors, staged, writes, give_back=give_back)

    # ------------------------------------------------------------------ the device side
    def _stage_ahead(self, job: Job) -> None:
        """Issue ``job``'s copy to the device now, so that it runs during the work before it,
        when its bytes are in host memory and the device has room (else the copy is issued
        when the job is acquired)."""
        staging = self._device_side.staging_for(self.resident_tier(job.name))
        if staging is None or not staging.landed(job.name):
            return  # no copy to issue, or its last results still land in its host tensors
        tensors = self._kept[HOST].get(job.name)
        reading = self._reading.get(job.name)
        if tensors is None and reading is not None and reading.job == job and reading.done.done():
            tensors = None if reading.done.exception() else reading.tensors
        if tensors is not None:
            staging.ahead(job.name, job.nbytes, tensors)

    # ------------------------------------------------------------------ budget and buffers
    def _make_room(self, nbytes: int, sizes: Sequence[int] = ()) -> list[torch.Tensor | None]:
        """Reserve ``nbytes`` in the host ledger and claim idle buffers for reads of ``sizes`` bytes
        (``None`` where none is idle); the caller holds the condition. Write-behinds free room as
        they end, each giving its buffers back for the next reads to reuse. Without any in flight,
        what holds the room is resident jobs and the work buffer (``BudgetError`` when they leave
        too little) and reads started ahead for this pass, which are dropped, latest first."""
        while (claimed := self._buffers.claim_and_reserve(nbytes, list(sizes))) is None:
            resident = self._kept[HOST].nbytes + self._buffers.work_bytes
            if (
                resident + nbytes > self.budget
                and self._buffers.work_bytes
                and not self._work_wanted
            ):
                self._buffers.drop_work()  # held for earlier jobs: this run's need none
                continue
            if resident + nbytes > self.budget:
                raise BudgetError(
                    f"a job of {nbytes} bytes does not fit the pipeline's budget of "
                    f"{self.budget} bytes beside {resident} bytes of resident jobs and work "
                    "buffer; raise the budget"
                )
            if self._disk.in_flight or self._lent:
                self._cv.wait()
            elif self._reading:
                self._cv.release()
                try:
                    self._drop_reading(next(reversed(self._reading)))
                finally:
                    self._cv.acquire()
            else:  # nothing will free the room: the ledger says what holds it
                self._ledgers[HOST].reserve(nbytes, can_wait=lambda: False)
        return claimed

    def _buffer_sizes(self, job: Job) -> list[int]:
        """Bytes of the buffers ``job`` takes from the pool: one per read."""
        return [region.numel * self._dtype(region.key).itemsize for region in job.buffers]

    def _start_reads(self, job: Job, *, wait: bool) -> bool:
        """Reserve ``job``'s bytes and start its reads into idle pooled buffers (or new ones);
        ``wait`` for the room (:meth:`_make_room`), else take only room free now beside
        :attr:`write_room` (whether the reads started)."""
        sizes = self._buffer_sizes(job)  # outside the condition: it may ask the store
        claimed: list[torch.Tensor | None] | None
        with self._cv:
            if wait:
                claimed = self._make_room(job.nbytes, sizes)
            else:
                claimed = self._buffers.claim_and_reserve(
                    job.nbytes, sizes, keep_free=self.write_room
                )
        if claimed is None:
            return False
        tensors: dict[Region, torch.Tensor] = {}
        try:
            buffers = self._buffers.take_all(claimed, sizes)
            for region, buf, nbytes in zip(job.buffers, buffers, sizes, strict=True):
                tensors[region] = buf[:nbytes].view(self._dtype(region.key))
            reads = {region: tensors[region] for region in job.reads}
            done = self._disk.read_all(reads)  # after the writes it overlaps reach the store
        except BaseException:
            self._give_back(job, tensors)
            raise
        self._reading[job.name] = _Reading(job, tensors, done)
        return True

    def _give_back(self, job: Job, tensors: dict[Region, torch.Tensor]) -> None:
        """Return a finished (or failed) job's bytes to the budget and its buffers to the pool."""
        held = (tensors[region] for region in job.buffers if region in tensors)
        self._buffers.give_back(held, job.nbytes)

    def _dtype(self, key: str) -> torch.dtype:
        dtype = self._dtypes.get(key)
        if dtype is None:
            dtype = self._dtypes[key] = self._store.info(key).dtype
        return dtype

    # ------------------------------------------------------------------ ends of a pass
    @settled_first
    def drain(self) -> None:
        """Wait for every write-behind and every copy back into host-resident tensors; raise
        the first write that failed."""
        self._disk.wait()
        self._staging.wait_landing()
        self._disk.raise_errors()

    @settled_first
    def release(self, names: Iterable[Hashable] | None = None) -> None:
        """Drop reads and device copies started ahead that no job consumed (e.g. prefetched,
        then not stepped): all of them, or those of the jobs ``names``."""
        if names is None:
            self._staging.drop_all()
            for name in list(self._reading):
                self._drop_reading(name)
            return
        for name in names:
            if name in self._reading:
                self._drop_reading(name)

    def _drop_reading(self, name: Hashable) -> None:
        self._staging.drop(name)
        reading = self._reading.pop(name)
        reading.done.exception()  # wait: the buffers are being filled
        self._give_back(reading.job, reading.tensors)

    @settled_first
    def flush(self, *, transient: bool = False) -> None:
        """Write every resident job's tensors to the store (with ``transient``, its
        ``Job.transient`` regions too) and wait for all writes."""
        moved = self._start_flush(transient=transient)
        self.drain()  # waits for the writes, and raises the first that failed
        self._flushed(moved)

    @settled_first
    def flush_behind(self, then: Callable[[], T], ended: Ended) -> Future[T]:
        """Start writing every resident job's tensors (as :meth:`flush`, without the
        transient regions) and return; on a thread of its own, once all writes have ended,
        call ``then`` (the store's commit, which must hold them). Every later call of the
        pipeline but the queries (:meth:`landed`, :meth:`resident_tier`, :attr:`held`,
        :meth:`stats`) waits for it first: the resident tensors are being written from, and
        the store must take no newer write before ``then``. That call, on its thread, calls
        ``ended`` with the failure (``None``) and the time it ended, and raises the failure
        (once; the returned future holds it too); after a failure the resident jobs still
        count as :meth:`unflushed`."""
        moved = self._start_flush(transient=False)

        def finish() -> T:
            self._disk.wait()
            self._disk.raise_errors()
            return then()

        def settled(error: BaseException | None, at: float) -> None:
            if error is None:
                self._flushed(moved)
            ended(error, at)

        return self._behind.start(finish, settled)

    def settle(self) -> None:
        """Wait for the work of :meth:`flush_behind`, if any; raise its failure (once)."""
        self._behind.settle()

    def _start_flush(self, *, transient: bool) -> dict[TierName, int]:
        """Start writing every resident job's tensors (:meth:`flush`); the bytes of each
        tier."""
        self._staging.wait_landing()
        on_host: dict[Region, torch.Tensor] = {}
        moved = dict.fromkeys(self._kept, 0)
        for tier, tensors in self._resident.to_write(transient=transient):
            moved[tier] += nbytes_of(tensors)
            if tier == DEVICE and self._transfers.moves:
                # a region at a time: a job resident on the device (the parameters it writes
                # beside its state) can be larger than the host budget's room
                for region, tensor in tensors.items():
                    self.write_behind({region: tensor})
            else:
                on_host.update(tensors)
        self._disk.write(on_host)
        return moved

    def _flushed(self, moved: dict[TierName, int]) -> None:
        """A flush's writes have ended: the resident jobs count as flushed, the bytes as
        moved out of their tiers."""
        self._resident.flushed()
        for tier, nbytes in moved.items():
            self._ledgers[tier].count_moved(out=nbytes)

    @settled_first
    def write(self, writes: dict[Region, torch.Tensor]) -> Future[Any]:
        """Start writing ``writes`` straight from the caller's host tensors (no copy: they
        must not change until the future completes); its failure is the future's alone (not
        raised by :meth:`run` or :meth:`drain`). Ordered as a write-behind: a later read of
        an overlapping region waits for it, and :meth:`drain` waits for it to end."""
        return self._write(writes, keep_errors=False)

    @settled_first
    def write_behind(self, writes: dict[Region, torch.Tensor]) -> None:
        """Write ``writes`` (on the host or the device) behind the caller, from copies (cast to
        the stored arrays' dtypes) in pooled host buffers reserved in the host budget, given
        back once the write has ended: the caller may change or drop its tensors when this
        returns. A later read of an overlapping region waits for the write; a failure is
        raised by :meth:`run` or :meth:`drain`, as a job's write-behind is."""
        dtypes = {region: self._dtype(region.key) for region in writes}  # may ask the store
        sizes = {region: region.numel * dtypes[region].itemsize for region in writes}
        nbytes = sum(map(footprint, sizes.values()))
        if not nbytes:
            return
        with self._cv:
            claimed = self._make_room(nbytes, list(sizes.values()))
        buffers: list[torch.Tensor] = []
        try:
            buffers = self._buffers.take_all(claimed, list(sizes.values()))
            host = {
                region: buf[: sizes[region]].view(dtypes[region])
                for region, buf in zip(writes, buffers, strict=True)
            }
            on_host, landed = to_host_all(self._transfers, host, writes)
        except BaseException:
            self._buffers.give_back(buffers, nbytes)
            raise
        then = lambda _: self._buffers.give_back(buffers, nbytes)  # noqa: E731
        self._write(on_host, after=landed, then=then)

    def _write(
        self,
        writes: dict[Region, torch.Tensor],
        *,
        after: Future[Any] | None = None,
        then: Callable[[BaseException | None], None] | None = None,
        keep_errors: bool = True,
    ) -> Future[Any]:
        """Start writing ``writes`` on the disk (:meth:`Disk.write`), which orders later reads
        of their regions after them; first drop the reads started ahead that overlap them:
        those may have read the bytes the writes replace."""
        stale = [
            name
            for name, reading in self._reading.items()
            if any(overlap(a, b) for a in reading.job.reads for b in writes)
        ]
        for name in stale:
            self._drop_reading(name)
        return self._disk.write(writes, after=after, then=then, keep_errors=keep_errors)

    @settled_first
    def evict(self) -> None:
        """Write resident tensors back and drop them (before the store's keys are rewritten),
        and let the work buffer go."""
        self._staging.drop_all()
        self.flush(transient=True)
        with self._cv:
            self._buffers.drop_work()
            self._resident.clear()  # freed, not pooled, as their bytes leave the ledger
            self._held.clear()
            self._dtypes.clear()

    @settled_first
    def unflushed(self, name: Hashable) -> bool:
        """Whether resident job ``name``'s tensors changed (its work, or :meth:`touch`) since
        they were read or last flushed: the store's copy is older."""
        return self._resident.unflushed(name)

    @settled_first
    def touch(self, name: Hashable) -> None:
        """The caller changed resident job ``name``'s tensors in place (:meth:`unflushed`)."""
        self._resident.touch(name)

    @settled_first
    def reload(self, name: Hashable, regions: Iterable[Region]) -> None:
        """Read ``regions`` of job ``name``, if resident, back from the store into its tensors
        (the store's copies went back to a savepoint), after the writes in flight; it then
        counts as flushed. On a GPU a device region passes through a host tensor of its own,
        outside the budgets (one at a time: rollbacks are rare)."""
        self._staging.wait_landing(name)
        self._resident.reload(name, regions, self._disk)

    @settled_first
    def resident(self, name: Hashable) -> dict[Region, torch.Tensor] | None:
        """The tensors of resident job ``name`` (``None`` when it is not in memory)."""
        self._staging.wait_landing(name)
        tier = self.resident_tier(name)
        return self._kept[tier][name] if tier is not None else None

    def resident_tier(self, name: Hashable) -> TierName | None:
        """The tier holding job ``name`` between passes, or ``None`` (streamed)."""
        return self._resident.tier(name)

    @property
    def held(self) -> int:
        """Host bytes held now: jobs resident in host memory, jobs in flight and the work
        buffer."""
        with self._cv:
            return self._ledgers[HOST].used

    def stats(self) -> CacheStats:
        """Each memory tier (used, budget, peak, hits, misses, bytes in and out), the store's
        traffic since the pipeline was made and the time spent waiting for reads: the shape of
        :meth:`TierCache.stats`."""
        device, host = self._ledgers[DEVICE], self._ledgers[HOST]
        return CacheStats.of(device, host, self._disk.traffic(), self.stall_seconds)
