"""The pipeline's parts on their own: the jobs' host buffers and the work buffer."""

from __future__ import annotations

import threading

import torch

from tierswap.engine import Ledger
from tierswap.pipeline._buffers import JobBuffers

PAGE = 4096


class _Books:
    """A ledger, its condition and the buffers counted in it."""

    def __init__(self, budget: int) -> None:
        self.cv = threading.Condition()
        self.host = Ledger("host", budget, self.cv)
        self.buffers = JobBuffers(self.host, self.cv)

    def claim(self, nbytes: int, sizes: list[int]) -> list[torch.Tensor | None] | None:
        with self.cv:
            return self.buffers.claim_and_reserve(nbytes, sizes)


def test_no_room_claims_and_reserves_nothing() -> None:
    books = _Books(3 * PAGE)
    assert books.claim(2 * PAGE, [PAGE, PAGE]) == [None, None]
    assert books.host.used == 2 * PAGE
    books.buffers.give_back(books.buffers.take_all([None, None], [PAGE, PAGE]), 2 * PAGE)
    assert books.host.used == 0
    # two idle pages sit in the pool; a job of four pages cannot fit the three-page budget
    assert books.claim(4 * PAGE, [PAGE] * 4) is None
    assert books.host.used == 0


def test_idle_buffers_are_reused_and_a_job_of_the_whole_budget_still_fits() -> None:
    books = _Books(3 * PAGE)
    assert books.claim(PAGE, [PAGE]) == [None]
    (first,) = books.buffers.take_all([None], [PAGE])
    books.buffers.give_back([first], PAGE)
    claimed = books.claim(PAGE, [PAGE])
    assert claimed is not None
    assert claimed[0] is not None
    assert claimed[0].data_ptr() == first.data_ptr()  # the idle page, not a new one
    books.buffers.give_back([claimed[0]], PAGE)
    # the idle page counts against the room, so it is trimmed for a job of the whole budget
    assert books.claim(3 * PAGE, [3 * PAGE]) == [None]
    assert books.host.used == 3 * PAGE


def test_the_work_buffer_is_held_until_dropped() -> None:
    books = _Books(8 * PAGE)
    buffers = books.buffers
    assert buffers.work is None
    with books.cv:
        books.host.reserve(2 * PAGE, can_wait=lambda: False)
        buffers.hold_work(2 * PAGE)
    work = buffers.work
    assert work is not None
    assert work.numel() >= 2 * PAGE
    assert buffers.work_bytes == 2 * PAGE
    with books.cv:
        buffers.drop_work()
    assert buffers.work is None
    assert books.host.used == 0
    # the dropped buffer is idle in the pool: the next request of its size reuses it
    claimed = books.claim(2 * PAGE, [2 * PAGE])
    assert claimed is not None
    assert claimed[0] is not None
    assert claimed[0].data_ptr() == work.data_ptr()
