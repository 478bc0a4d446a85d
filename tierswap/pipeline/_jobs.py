"""What a pipeline moves: the jobs, each naming the regions of stored tensors it reads (the
engine's :class:`~tierswap.engine.Region`), and the work that runs on them.

Private to :mod:`tierswap.pipeline`, which re-exports the public names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch

from tierswap.engine import Region
from tierswap.errors import ConfigError
from tierswap.tiers import DEVICE, HOST, TierName

__all__ = ["Job", "Work"]


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
    ``unread`` names regions that get buffers as reads do (counted in ``nbytes`` too) but are
    not read: the work fills them (values it has in memory) before it uses them.
    ``transient`` names regions of a resident job that no later pass needs from the store,
    as the caller fills them before each (a gradient kept for one step): :meth:`Pipeline.
    flush` does not write them (:meth:`Pipeline.evict` does: the job's tensors go).
    """

    name: Hashable
    reads: tuple[Region, ...]
    nbytes: int
    resident: bool = False
    tier: TierName | None = None
    scratch: int = 0
    unread: tuple[Region, ...] = ()
    transient: tuple[Region, ...] = ()

    @property
    def buffers(self) -> tuple[Region, ...]:
        """The regions that get buffers: those read, then those the work fills."""
        return self.reads + self.unread

    def __post_init__(self) -> None:
        if self.tier not in (None, DEVICE, HOST):
            raise ConfigError(f"Job.tier={self.tier!r} must be None, 'device' or 'host'")
        if self.scratch < 0:
            raise ConfigError(f"Job.scratch={self.scratch} must be >= 0 (bytes of work buffer)")
        if self.resident and self.tier is None:
            object.__setattr__(self, "tier", HOST)


#: ``work(job, tensors) -> writes``: ``tensors`` maps each of ``job.buffers`` to a 1-D CPU tensor;
#: the returned mapping names the regions to write back and their new contents.
Work = Callable[[Job, dict[Region, torch.Tensor]], dict[Region, torch.Tensor]]
