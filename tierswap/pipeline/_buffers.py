"""The host buffers of a pipeline's jobs: one per read, and one work buffer that the jobs' work
shares, taken from one pool and counted in the host ledger (idle buffers too: the pool is
trimmed to the room the ledger has left). Private to :mod:`tierswap.pipeline`."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from tierswap.engine import BufferPool, Ledger

__all__ = ["JobBuffers"]


class JobBuffers:
    """Buffers of the jobs in flight, reused from one pass to the next, their bytes reserved in
    ``host`` (guarded by ``cv``, the pipeline's): methods documented "the caller holds the
    condition" run under it, the others take it. The work buffer serves one job's work at a time
    and stays, its bytes reserved, until :meth:`drop_work`."""

    def __init__(self, host: Ledger, cv: threading.Condition) -> None:
        self._host, self._cv = host, cv
        self._pool = BufferPool()
        self._work: torch.Tensor | None = None
        self.work_bytes = 0  # reserved for the work buffer

    def claim_and_reserve(
        self, nbytes: int, sizes: list[int], *, keep_free: int = 0
    ) -> list[torch.Tensor | None] | None:
        """Reserve ``nbytes`` at once and claim idle buffers for requests of ``sizes`` bytes
        (``None`` where none is idle); ``None`` (nothing claimed or reserved) when the ledger
        has no room now, or would have less than ``keep_free`` bytes left after. The claimed
        buffers leave the free list before the pool is trimmed for the reservation: the job
        reuses them instead of faulting in new memory. The caller holds the condition."""
        if self._host.free < nbytes + keep_free:  # no room even without idle buffers
            return None
        claimed = self._pool.claim(sizes)
        self.trim_for(nbytes)
        if self._host.try_reserve(nbytes):
            return claimed
        self._pool.give_all(claimed)
        return None

    def trim_for(self, nbytes: int) -> None:
        """Free idle buffers until ``nbytes`` more fit beside them. The caller holds the
        condition."""
        self._pool.trim(max(self._host.free - nbytes, 0))

    def take_all(self, claimed: list[torch.Tensor | None], sizes: list[int]) -> list[torch.Tensor]:
        """A buffer for each request of ``sizes`` bytes (their bytes reserved by the caller):
        the ``claimed`` one, or one from the pool where that is ``None``. When one cannot be
        made, the claimed ones go back to the pool."""
        with self._cv:
            try:
                return [
                    c if c is not None else self._pool.take(n)
                    for c, n in zip(claimed, sizes, strict=True)
                ]
            except BaseException:
                self._pool.give_all(claimed)
                raise

    @property
    def work(self) -> torch.Tensor | None:
        """The work buffer (``work_bytes`` or more, uint8), or ``None`` before any."""
        return self._work

    def hold_work(self, nbytes: int) -> None:
        """Take the work buffer, ``nbytes`` already reserved in the ledger (replacing one that
        :meth:`drop_work` let go). The caller holds the condition."""
        assert self._work is None
        self._work, self.work_bytes = self._pool.take(nbytes), nbytes

    def drop_work(self) -> None:
        """Return the work buffer to the pool and its bytes to the ledger. The caller holds
        the condition."""
        if self._work is not None:
            self._pool.give(self._work)
            self._host.release(self.work_bytes)
        self._work, self.work_bytes = None, 0

    def give_back(self, buffers: Iterable[torch.Tensor], nbytes: int) -> None:
        """A job's pass ended: its read ``buffers`` go back to the pool, its ``nbytes`` to the
        ledger, and waiters are woken."""
        with self._cv:
            for buffer in buffers:
                self._pool.give(buffer)
            self._host.release(nbytes)
            self.trim_for(0)
            self._cv.notify_all()
