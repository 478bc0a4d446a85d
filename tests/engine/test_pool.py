"""The buffer pool: whole pages, reused by capacity, trimmed to the room a ledger leaves."""

from __future__ import annotations

import torch

from tierswap.config import ALIGN
from tierswap.engine import BufferPool, base_bytes


def test_buffers_are_whole_aligned_pages_and_come_back_by_capacity() -> None:
    pool = BufferPool()
    first = pool.take(100)
    assert first.numel() == ALIGN
    assert first.dtype == torch.uint8
    assert first.data_ptr() % ALIGN == 0
    pool.give(first[:100].view(-1))  # a view from the start gives back the whole buffer
    assert pool.idle == ALIGN
    again = pool.take(ALIGN)
    assert again.data_ptr() == first.data_ptr()  # reused, not allocated anew
    assert pool.idle == 0
    other = pool.take(ALIGN + 1)
    assert other.numel() == 2 * ALIGN


def test_claim_takes_idle_buffers_before_a_trim_and_give_all_returns_them() -> None:
    pool = BufferPool()
    pool.give(pool.take(ALIGN))
    pool.give(pool.take(3 * ALIGN))
    claimed = pool.claim([ALIGN, 2 * ALIGN, 3 * ALIGN])
    assert [c is None for c in claimed] == [False, True, False]
    assert pool.idle == 0
    pool.trim(0)  # nothing idle to free: the claimed buffers survive
    pool.give_all(claimed)
    assert pool.idle == 4 * ALIGN


def test_trim_frees_the_largest_idle_buffers_first() -> None:
    pool = BufferPool()
    for pages in (1, 2, 4):
        pool.give(pool.take(pages * ALIGN))
    pool.trim(3 * ALIGN)
    assert pool.idle == 3 * ALIGN  # the 4-page buffer went
    assert [c is not None for c in pool.claim([ALIGN, 2 * ALIGN, 4 * ALIGN])] == [
        True,
        True,
        False,
    ]


def test_foreign_tensors_and_views_that_do_not_start_a_buffer_are_not_pooled() -> None:
    pool = BufferPool()
    buffer = pool.take(2 * ALIGN)
    pool.give(buffer[ALIGN:])  # does not start at the buffer: not the pool's to keep
    pool.give(torch.ones(3))  # not whole pages
    assert pool.idle == 0
    assert base_bytes(torch.ones(3)) is None
