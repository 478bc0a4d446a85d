"""Buffers reused across passes, in whole pages, for one memory tier.

Private to :mod:`tierswap.engine`.
"""

from __future__ import annotations

import torch

from tierswap.config import ALIGN
from tierswap.io import aligned_empty, footprint

__all__ = ["BufferPool", "allocate", "base_bytes"]


class BufferPool:
    """Page-aligned byte buffers by capacity, reused across passes so that reads land in memory that
    is already mapped (a fresh buffer costs a page fault per 4 KiB on first touch). Not
    thread-safe: callers hold their front end's lock, and :meth:`trim` keeps the idle buffers
    within the room their tier's ledger has left."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device if device is not None else torch.device("cpu")
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0

    @property
    def idle(self) -> int:
        """Bytes of buffers on the free list."""
        return self._idle

    def take(self, nbytes: int) -> torch.Tensor:
        capacity = footprint(nbytes)
        free = self._free.get(capacity)
        if free:
            self._idle -= capacity
            return free.pop()
        return allocate((capacity,), torch.uint8, self._device)

    def claim(self, sizes: list[int]) -> list[torch.Tensor | None]:
        """Idle buffers for requests of ``sizes`` bytes, taken off the free list before a
        :meth:`trim` could free them (``None`` where none is idle): the caller reserves their
        bytes next, or gives them back with :meth:`give_all`."""
        claimed: list[torch.Tensor | None] = []
        for nbytes in sizes:
            capacity = footprint(nbytes)
            free = self._free.get(capacity)
            claimed.append(free.pop() if free else None)
            if claimed[-1] is not None:
                self._idle -= capacity
        return claimed

    def give_all(self, tensors: list[torch.Tensor | None]) -> None:
        """:meth:`give` each of ``tensors`` that is not ``None``."""
        for tensor in tensors:
            if tensor is not None:
                self.give(tensor)

    def give(self, tensor: torch.Tensor) -> None:
        raw = base_bytes(tensor)
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


def allocate(
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    device: torch.device | None = None,
    *,
    pin: bool | None = None,
) -> torch.Tensor:
    """A fresh, uninitialised buffer in one tier's memory: the engine's one allocator (the pool's,
    and the cache's items, which come in every size and are not recycled). On the CPU it is
    page-aligned and spans whole 4 KiB pages (:func:`tierswap.io.aligned_empty`; ``pin=None`` pins
    it when CUDA is present); elsewhere an ordinary tensor in that device's memory. The caller has
    reserved its bytes in the tier's :class:`Ledger`."""
    if device is not None and device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return aligned_empty(shape, dtype, pin=pin)


def base_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole page-rounded uint8 buffer a pool tensor was cut from (``None`` for others)."""
    storage = tensor.untyped_storage()
    if tensor.storage_offset() != 0 or storage.nbytes() % ALIGN:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
