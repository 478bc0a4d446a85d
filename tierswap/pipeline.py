"""The streaming pipeline: read ahead, work, write behind, within one byte budget.

A cyclic workload over data larger than memory (an optimizer step, a pass over stored
activations) is a list of :class:`Job` s, each naming the :class:`Region` s (element ranges of
stored tensors) it needs. :meth:`Pipeline.run` moves every job through three stages:

1. **read-ahead**: the job's regions are read from the store into page-aligned (pinned when CUDA
   is present) host buffers as soon as the budget has room, several jobs ahead of the work;
2. **work**: the caller's function runs on the caller's thread with the job's tensors and returns
   the tensors to write back (the same buffers, updated in place, or new ones);
3. **write-behind**: those tensors are written to the store asynchronously; the job's bytes return
   to the budget when its writes finish, while later jobs already work.

Each byte is read once and written once per pass. *Resident* jobs skip stages 1 and 3 after their
first pass: their tensors stay in memory (counted in the budget) until :meth:`Pipeline.flush`.
For a cyclic schedule, keeping a fixed prefix resident and streaming the rest is what Belady's
rule does: the job just finished is the one used furthest in the future.

Thread safety: ``prefetch``, ``run``, ``flush``, ``drain`` and ``release`` are called from one
thread at a time (the caller's); I/O completions arrive on the store's threads and only touch
the budget and the buffer pool, under one condition variable.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tierswap.config import ALIGN, Size, parse_size, round_up
from tierswap.errors import BudgetError
from tierswap.io import aligned_empty, gather

if TYPE_CHECKING:
    from tierswap.store import ArrayInfo

__all__ = ["Job", "Pipeline", "Region", "Work", "write_regions"]


@dataclasses.dataclass(frozen=True)
class Region:
    """Elements ``[start, stop)`` of the flattened tensor stored under ``key``."""

    key: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Job:
    """One unit of work: the regions it reads and the host bytes it holds while in flight.

    ``nbytes`` must cover the read buffers and anything the work allocates that lives until the
    write-behind ends (e.g. state created on a first pass). ``resident`` jobs keep their tensors
    in memory between passes.
    """

    name: Hashable
    reads: tuple[Region, ...]
    nbytes: int
    resident: bool = False


#: ``work(job, tensors) -> writes``: ``tensors`` maps each of ``job.reads`` to a 1-D CPU tensor;
#: the returned mapping names the regions to write back and their new contents.
Work = Callable[[Job, dict[Region, torch.Tensor]], dict[Region, torch.Tensor]]


@dataclasses.dataclass
class _Reading:
    """A job whose reads have started: its buffers and the future of all its reads."""

    job: Job
    tensors: dict[Region, torch.Tensor]
    done: Future[Any]


class RegionStore(Protocol):
    """What :class:`Pipeline` needs from a store: region reads and writes and array info."""

    def info(self, key: str) -> ArrayInfo: ...

    def get_region_async(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> Future[torch.Tensor]: ...

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]: ...


class Pipeline:
    """Read-ahead / work / write-behind over a :class:`~tierswap.SwapStore` within ``budget``.

    Parameters
    ----------
    store:
        The store holding the regions: a :class:`~tierswap.SwapStore` or any other
        :class:`RegionStore`.
    budget:
        Host bytes (or a size such as ``"4GiB"``) the pipeline may hold at once: resident
        jobs, jobs read ahead, the job at work and jobs being written back. A job larger than
        the budget raises ``BudgetError``.
    """

    def __init__(self, store: RegionStore, budget: Size) -> None:
        self._store = store
        self.budget = parse_size(budget, name="budget")
        self._cv = threading.Condition()
        self._held = 0  # bytes of jobs between the start of their reads and their writes' end
        self._reading: dict[Hashable, _Reading] = {}
        self._resident: dict[Hashable, dict[Region, torch.Tensor]] = {}
        self._resident_bytes: dict[Hashable, int] = {}
        self._writes: list[Future[Any]] = []
        self._errors: list[BaseException] = []
        self._pool = _BufferPool()
        self._dtypes: dict[str, torch.dtype] = {}
        self.hits = self.misses = 0
        self.stall_seconds = 0.0

    # ------------------------------------------------------------------ the three stages
    def prefetch(self, jobs: Iterable[Job]) -> None:
        """Start reading ``jobs`` (in order) while the budget has room; never blocks."""
        for job in jobs:
            if job.name in self._reading or job.name in self._resident:
                continue
            with self._cv:
                if self._held + job.nbytes > self.budget:
                    return
                self._held += job.nbytes
            self._start_reads(job)

    def run(self, jobs: Sequence[Job], work: Work) -> None:
        """Run every job through read-ahead, ``work`` and write-behind, in order.

        Returns once the last job's work is done; its writes may still be in flight
        (:meth:`drain` waits for them). A failed write-behind is raised here or by ``drain``.
        """
        for position, job in enumerate(jobs):
            self._raise_write_errors()
            tensors = self._acquire(job)
            self.prefetch(jobs[position + 1 :])
            try:
                writes = work(job, tensors)
            except BaseException:
                if job.name not in self._resident:  # a resident job keeps its tensors
                    self._give_back(job, tensors)
                raise
            self._finish(job, tensors, writes)
            self.prefetch(jobs[position + 1 :])

    def _acquire(self, job: Job) -> dict[Region, torch.Tensor]:
        """The job's tensors: resident ones at once, else its reads (started here if need be)."""
        if job.name in self._resident:
            self.hits += 1
            return self._resident[job.name]
        self.misses += 1
        started = time.perf_counter()
        stale = self._reading.get(job.name)
        if stale is not None and stale.job != job:  # read ahead for other regions: redo
            self._drop_reading(job.name)
        if job.name not in self._reading:
            self._wait_for_room(job.nbytes)
            self._start_reads(job)
        reading = self._reading.pop(job.name)
        try:
            reading.done.result()
        except BaseException:
            self._give_back(job, reading.tensors)
            raise
        finally:
            self.stall_seconds += time.perf_counter() - started
        return reading.tensors

    def _finish(
        self, job: Job, tensors: dict[Region, torch.Tensor], writes: dict[Region, torch.Tensor]
    ) -> None:
        """Keep a resident job's tensors, or write the job back and free it when done."""
        if job.resident:
            kept = self._resident.setdefault(job.name, {})
            kept.update(tensors)
            kept.update(writes)
            self._resident_bytes[job.name] = job.nbytes
            return
        try:
            done = write_regions(self._store, writes)
        except BaseException:
            self._give_back(job, tensors)
            raise
        with self._cv:
            self._writes.append(done)
        done.add_done_callback(lambda f: self._written(job, tensors, f))

    def _written(self, job: Job, tensors: dict[Region, torch.Tensor], done: Future[Any]) -> None:
        error = done.exception()
        with self._cv:
            if error is not None:
                self._errors.append(error)
            if done in self._writes:
                self._writes.remove(done)
        self._give_back(job, tensors)

    # ------------------------------------------------------------------ budget and buffers
    def _wait_for_room(self, nbytes: int) -> None:
        with self._cv:
            if self._resident_total() + nbytes > self.budget:
                raise BudgetError(
                    f"a job of {nbytes} bytes does not fit the pipeline's budget of {self.budget} "
                    f"bytes beside {self._resident_total()} resident bytes; raise the budget"
                )
            # Write-behinds free room as they finish. Without any in flight, what holds the room
            # is resident jobs (checked above) and reads started ahead for this pass.
            while self._held + nbytes > self.budget and self._writes:
                self._cv.wait()
            self._held += nbytes

    def _start_reads(self, job: Job) -> None:
        tensors: dict[Region, torch.Tensor] = {}
        try:
            futures = []
            for region in job.reads:
                dtype = self._dtype(region.key)
                nbytes = region.numel * dtype.itemsize
                with self._cv:
                    buf = self._pool.take(nbytes)
                tensors[region] = out = buf[:nbytes].view(dtype)
                futures.append(
                    self._store.get_region_async(region.key, region.start, region.stop, out=out)
                )
        except BaseException:
            self._give_back(job, tensors)
            raise
        self._reading[job.name] = _Reading(job, tensors, gather(futures))

    def _give_back(self, job: Job, tensors: dict[Region, torch.Tensor]) -> None:
        """Return a finished (or failed) job's bytes to the budget and its buffers to the pool."""
        with self._cv:
            for region in job.reads:
                tensor = tensors.get(region)
                if tensor is not None:
                    self._pool.give(tensor)
            self._held -= job.nbytes
            self._pool.trim(max(self.budget - self._held, 0))
            self._cv.notify_all()

    def _dtype(self, key: str) -> torch.dtype:
        dtype = self._dtypes.get(key)
        if dtype is None:
            dtype = self._dtypes[key] = self._store.info(key).dtype
        return dtype

    def _resident_total(self) -> int:
        return sum(self._resident_bytes.values())

    # ------------------------------------------------------------------ ends of a pass
    def drain(self) -> None:
        """Wait for every write-behind; raise the first one that failed."""
        while True:
            with self._cv:
                pending = list(self._writes)
            if not pending:
                break
            for future in pending:
                future.exception()
        self._raise_write_errors()

    def release(self) -> None:
        """Drop reads started ahead that no job consumed (e.g. prefetched, then not stepped)."""
        for name in list(self._reading):
            self._drop_reading(name)

    def _drop_reading(self, name: Hashable) -> None:
        reading = self._reading.pop(name)
        reading.done.exception()  # wait: the buffers are being filled
        self._give_back(reading.job, reading.tensors)

    def flush(self) -> None:
        """Write every resident job's tensors to the store and wait for all writes."""
        resident = {r: t for tensors in self._resident.values() for r, t in tensors.items()}
        write_regions(self._store, resident).result()
        self.drain()

    def evict(self) -> None:
        """Write resident tensors back and drop them (before the store's keys are rewritten)."""
        self.flush()
        with self._cv:
            for name, tensors in self._resident.items():
                for tensor in tensors.values():
                    self._pool.give(tensor, owned=False)
                self._held -= self._resident_bytes.get(name, 0)
            self._resident.clear()
            self._resident_bytes.clear()
            self._dtypes.clear()

    def resident(self, name: Hashable) -> dict[Region, torch.Tensor] | None:
        """The tensors of resident job ``name`` (``None`` when it is not in memory)."""
        return self._resident.get(name)

    @property
    def held(self) -> int:
        """Host bytes held now: resident jobs and jobs in flight."""
        with self._cv:
            return self._held

    def _raise_write_errors(self) -> None:
        with self._cv:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


def write_regions(store: RegionStore, writes: Mapping[Region, torch.Tensor]) -> Future[Any]:
    """Start writing every region of ``writes``; one future for all of them (its result raises
    the first failure once every write has ended). When a write cannot even start, the writes
    already started are waited for before the error is raised, so the caller may reuse the
    tensors at once."""
    futures: list[Future[Any]] = []
    try:
        for region, tensor in writes.items():
            futures.append(store.put_region_async(region.key, region.start, tensor))
    except BaseException:
        gather(futures).exception()
        raise
    return gather(futures)


class _BufferPool:
    """Page-aligned byte buffers by capacity, reused across passes so that reads land in memory
    that is already mapped (a fresh buffer costs a page fault per 4 KiB on first touch).

    Callers hold the pipeline's lock; ``trim`` keeps the idle buffers within the budget left.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0

    def take(self, nbytes: int) -> torch.Tensor:
        capacity = max(round_up(nbytes, ALIGN), ALIGN)
        free = self._free.get(capacity)
        if free:
            self._idle -= capacity
            return free.pop()
        return aligned_empty((capacity,), torch.uint8)

    def give(self, tensor: torch.Tensor, *, owned: bool = True) -> None:
        if not owned:
            return
        raw = _base_bytes(tensor)
        if raw is None:
            return
        self._free.setdefault(raw.numel(), []).append(raw)
        self._idle += raw.numel()

    def trim(self, room: int) -> None:
        """Free idle buffers, largest first, until they fit in ``room`` bytes."""
        for capacity in sorted(self._free, reverse=True):
            free = self._free[capacity]
            while free and self._idle > room:
                free.pop()
                self._idle -= capacity


def _base_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole page-rounded uint8 buffer a pool tensor was cut from (``None`` for others)."""
    storage = tensor.untyped_storage()
    if tensor.storage_offset() != 0 or storage.nbytes() % ALIGN:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
