"""What a pipeline moves: regions of stored tensors, the jobs that read them, the store they
live in, and the one call that writes a job's results back.

Private to :mod:`tierswap.pipeline`, which re-exports the public names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tierswap.errors import ConfigError
from tierswap.io import gather
from tierswap.tiers import DEVICE, HOST, TierName

if TYPE_CHECKING:
    from tierswap.store import ArrayInfo

__all__ = ["Job", "Region", "RegionStore", "Work", "nbytes_of", "overlap", "write_regions"]


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
    write-behind ends (e.g. state created on a first pass). A job with a ``tier`` (``"device"``
    or ``"host"``) keeps its tensors there between passes; ``resident=True`` is ``tier="host"``.
    ``scratch`` asks for a work buffer of that many bytes for the work's temporaries while it
    runs (not part of ``nbytes``): the work runs one job at a time, so the pipeline keeps one
    work buffer for all jobs (:meth:`Pipeline.scratch`), as large as the largest request,
    counted in its budget and reused from one job to the next without page faults.
    """

    name: Hashable
    reads: tuple[Region, ...]
    nbytes: int
    resident: bool = False
    tier: TierName | None = None
    scratch: int = 0

    def __post_init__(self) -> None:
        if self.tier not in (None, DEVICE, HOST):
            raise ConfigError(f"Job.tier={self.tier!r} must be None, 'device' or 'host'")
        if self.scratch < 0:
            raise ConfigError(f"Job.scratch={self.scratch} must be >= 0 (bytes of work buffer)")
        if self.resident and self.tier is None:
            object.__setattr__(self, "tier", HOST)


#: ``work(job, tensors) -> writes``: ``tensors`` maps each of ``job.reads`` to a 1-D CPU tensor;
#: the returned mapping names the regions to write back and their new contents.
Work = Callable[[Job, dict[Region, torch.Tensor]], dict[Region, torch.Tensor]]


class RegionStore(Protocol):
    """What :class:`Pipeline` needs from a store: region reads and writes and array info."""

    def info(self, key: str) -> ArrayInfo: ...

    def get_region_async(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> Future[torch.Tensor]: ...

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]: ...


def overlap(a: Region, b: Region) -> bool:
    """Whether ``a`` and ``b`` share elements of one stored tensor."""
    return a.key == b.key and a.start < b.stop and b.start < a.stop


def nbytes_of(tensors: Mapping[Region, torch.Tensor]) -> int:
    """Bytes of the tensors of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


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
