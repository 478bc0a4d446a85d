"""The host buffers of a pipeline's jobs: one per read and a work buffer (scratch) per job,
taken from one pool and counted in the host ledger.

A job's bytes are reserved in the ledger before its buffers are taken; idle pooled buffers
count against the room the ledger has left (the pool is trimmed to it), so buffers held plus
idle never exceed the budget. Private to :mod:`tierswap.pipeline`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

import torch

from tierswap.engine import BufferPool, Ledger

__all__ = ["JobBuffers"]


class JobBuffers:
    """Buffers of the jobs in flight, reused from one pass to the next.

    ``host`` is the ledger the jobs' bytes are reserved in and ``cv`` the condition that
    guards it (shared with the pipeline): methods documented "the caller holds the condition"
    must be called under it, the others take it themselves. A job may be read again for the
    next pass while its last write-behind still holds its work buffer, so a job's work
    buffers are kept oldest first.
    """

    def __init__(self, host: Ledger, cv: threading.Condition) -> None:
        self._host, self._cv = host, cv
        self._pool = BufferPool()
        self._scratch: dict[Hashable, list[torch.Tensor]] = {}

    def claim_and_reserve(self, nbytes: int, sizes: list[int]) -> list[torch.Tensor | None] | None:
        """Reserve ``nbytes`` at once and claim idle buffers for requests of ``sizes`` bytes
        (``None`` where none is idle); ``None`` (nothing claimed or reserved) when the ledger
        has no room now. The claimed buffers leave the free list before the pool is trimmed
        for the reservation: the job reuses them instead of faulting in new memory. The
        caller holds the condition."""
        if self._host.free < nbytes:  # no room even without idle buffers: trim nothing
            return None
        claimed = self._pool.claim(sizes)
        self._pool.trim(max(self._host.free - nbytes, 0))
        if self._host.try_reserve(nbytes):
            return claimed
        self._pool.give_all(claimed)
        return None

    def trim_for(self, nbytes: int) -> None:
        """Free idle buffers until ``nbytes`` more fit beside them. The caller holds the
        condition."""
        self._pool.trim(max(self._host.free - nbytes, 0))

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` or more (its bytes reserved by the caller)."""
        with self._cv:
            return self._pool.take(nbytes)

    def give_all(self, buffers: Iterable[torch.Tensor | None]) -> None:
        """Return unused buffers (claimed, then not needed) to the pool."""
        with self._cv:
            self._pool.give_all(list(buffers))

    def add_scratch(self, name: Hashable, claimed: torch.Tensor | None, nbytes: int) -> None:
        """Give job ``name`` its work buffer for this pass: ``claimed``, or a new one."""
        with self._cv:
            buffer = claimed if claimed is not None else self._pool.take(nbytes)
            self._scratch.setdefault(name, []).append(buffer)

    def scratch(self, name: Hashable) -> torch.Tensor | None:
        """The work buffer of job ``name``'s newest pass (``None``: it has none)."""
        with self._cv:
            held = self._scratch.get(name)
            return held[-1] if held else None

    def give_back(self, name: Hashable, buffers: Iterable[torch.Tensor], nbytes: int) -> None:
        """A pass of job ``name`` ended: its read ``buffers`` and its oldest work buffer go
        back to the pool, its ``nbytes`` to the ledger, and waiters are woken."""
        with self._cv:
            for buffer in buffers:
                self._pool.give(buffer)
            held = self._scratch.get(name)
            if held:
                self._pool.give(held.pop(0))  # the oldest: its pass is the one that ended
                if not held:
                    del self._scratch[name]
            self._host.release(nbytes)
            self._pool.trim(self._host.free)
            self._cv.notify_all()

    def forget(self, name: Hashable, host_tensors: Iterable[torch.Tensor]) -> None:
        """Job ``name`` stops being resident: its host tensors (views of pooled buffers or
        the work's own) are offered to the pool and its work buffer dropped. The caller holds
        the condition and releases the job's bytes from its tier's ledger."""
        for tensor in host_tensors:
            self._pool.give(tensor, owned=False)
        self._scratch.pop(name, None)
