"""Host buffers the I/O engine can read into and write from without a bounce copy.

O_DIRECT needs buffer addresses, lengths and file offsets aligned to 4 KiB. Buffers made here are
page-aligned and their capacity is rounded up to 4 KiB; when CUDA is present they are pinned
(page-locked, and the CUDA host allocator returns page-aligned memory), so host<->device copies can
run asynchronously on a side stream.
"""

from __future__ import annotations

import mmap

import torch

from tierswap.config import ALIGN, round_up

__all__ = ["aligned_empty", "cuda_pinning_available", "footprint", "is_aligned"]


def footprint(nbytes: int) -> int:
    """Bytes a buffer of ``nbytes`` occupies in memory: whole 4 KiB pages, at least one (the
    O_DIRECT alignment; :func:`aligned_empty` allocates that much). The one rule the tiers'
    budgets count by."""
    return max(round_up(nbytes, ALIGN), ALIGN)


_HUGE_PAGE = 2 << 20


def cuda_pinning_available() -> bool:
    """True when pinned host memory can be allocated (a CUDA device is present)."""
    return torch.cuda.is_available()


def aligned_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, pin: bool | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor whose storage starts on a page and spans whole pages.

    ``pin=None`` pins when CUDA is available. The tensor's storage is at least
    ``round_up(nbytes, 4096)`` bytes, so a whole-page read may land in it directly.
    """
    shape = tuple(shape)
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    capacity = footprint(nbytes)
    pin = cuda_pinning_available() if pin is None else pin
    if pin:
        raw = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
    else:
        raw = torch.frombuffer(_anonymous_map(capacity), dtype=torch.uint8)
    return raw[:nbytes].view(dtype).view(shape) if numel else raw[:0].view(dtype).view(shape)


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """Page-aligned zeroed memory; the tensor made from it keeps the mapping alive.

    Large mappings ask for transparent huge pages: a fresh buffer filled by O_DIRECT reads
    otherwise takes one page fault per 4 KiB, which costs more than the disk time.
    """
    # Private, not Python's default MAP_SHARED: shared anonymous memory is shmem, which takes no
    # transparent huge pages (shmem_enabled is usually "never") and stays shared with a child
    # after fork.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def is_aligned(address: int, length: int = 0) -> bool:
    """True when both ``address`` and ``length`` are multiples of the O_DIRECT alignment."""
    return address % ALIGN == 0 and length % ALIGN == 0
