"""The pipeline's resident jobs: their tensors in each memory tier between passes, and what of
them the store lacks.

Private to :mod:`tierswap.pipeline`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import torch

from tierswap.engine import Disk, Ledger, Region, ResidentSet
from tierswap.pipeline._jobs import Job
from tierswap.tiers import TierName

__all__ = ["ResidentJobs"]

Tensors = dict[Region, torch.Tensor]


class ResidentJobs:
    """The tensors of each resident job by tier (a :class:`~tierswap.engine.ResidentSet` on
    each tier's ledger: :attr:`books`), which of them changed since the store last had them
    (:meth:`unflushed`), and the regions a flush leaves out (``Job.transient``). Called under
    the pipeline's rules (one caller thread; the books under its condition)."""

    def __init__(self, ledgers: dict[TierName, Ledger]) -> None:
        self.books: dict[TierName, ResidentSet[Hashable, Tensors]] = {
            tier: ResidentSet(ledger) for tier, ledger in ledgers.items()
        }
        self._unflushed: set[Hashable] = set()
        self._transient: dict[Hashable, tuple[Region, ...]] = {}

    def tier(self, name: Hashable) -> TierName | None:
        """The tier holding job ``name`` between passes, or ``None`` (streamed)."""
        return next((tier for tier, book in self.books.items() if name in book), None)

    def changed(self, job: Job) -> None:
        """Resident ``job``'s work changed its tensors: the store lacks them until a flush,
        but for its ``transient`` regions, which no flush writes."""
        self._unflushed.add(job.name)
        self._transient[job.name] = job.transient

    def touch(self, name: Hashable) -> None:
        """A caller changed resident job ``name``'s tensors in place."""
        if self.tier(name) is not None:
            self._unflushed.add(name)

    def unflushed(self, name: Hashable) -> bool:
        """Whether job ``name``'s tensors changed since they were read or last flushed."""
        return name in self._unflushed

    def reload(self, name: Hashable, regions: Iterable[Region], disk: Disk) -> None:
        """Read ``regions`` of job ``name``, if resident, back from the store through ``disk``
        into its tensors (a device one through a host tensor of its own); it then counts as
        flushed."""
        tier = self.tier(name)
        tensors = self.books[tier][name] if tier is not None else {}
        for region in (r for r in regions if r in tensors):
            target = tensors[region]
            host = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
            disk.read_all({region: host}).result()
            if host is not target:
                target.copy_(host)
        self._unflushed.discard(name)

    def to_write(self, *, transient: bool) -> Iterator[tuple[TierName, Tensors]]:
        """Per resident job: its tier and the tensors a flush writes (with ``transient``, its
        transient regions too)."""
        for tier, book in self.books.items():
            for name, kept in book.items():
                skip = () if transient else self._transient.get(name, ())
                yield tier, {region: t for region, t in kept.items() if region not in skip}

    def flushed(self) -> None:
        """The store has every resident job's tensors."""
        self._unflushed.clear()

    def clear(self) -> None:
        """Drop every resident job (bytes released)."""
        for book in self.books.values():
            book.clear()
        self._unflushed.clear()
        self._transient.clear()
