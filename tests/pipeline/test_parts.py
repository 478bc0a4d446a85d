"""The pipeline's parts on their own: the jobs' host buffers and the write-behinds."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.engine import Ledger
from tierswap.pipeline import Region
from tierswap.pipeline._buffers import JobBuffers
from tierswap.pipeline._writes import WriteBehind

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
    books.buffers.give_back([books.buffers.take(PAGE), books.buffers.take(PAGE)], 2 * PAGE)
    assert books.host.used == 0
    # two idle pages sit in the pool; a job of four pages cannot fit the three-page budget
    assert books.claim(4 * PAGE, [PAGE] * 4) is None
    assert books.host.used == 0


def test_idle_buffers_are_reused_and_a_job_of_the_whole_budget_still_fits() -> None:
    books = _Books(3 * PAGE)
    assert books.claim(PAGE, [PAGE]) == [None]
    first = books.buffers.take(PAGE)
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


@pytest.fixture
def store(tmp_path: Path):
    with ts.SwapStore(tmp_path / "s", chunk_bytes=PAGE) as store:
        store.put("x", torch.zeros(4096))
        yield store


def test_a_write_waits_for_its_copy_and_blocks_reads_of_its_regions(store) -> None:
    cv = threading.Condition()
    writes = WriteBehind(store, cv)
    landed: Future[None] = Future()
    ended = threading.Event()
    writes.start(landed, {Region("x", 0, 1024): torch.ones(1024)}, then=ended.set)
    with cv:
        assert writes.in_flight
    assert writes.unsent_to([Region("x", 1000, 2000)])  # overlaps: a read must wait
    assert not writes.unsent_to([Region("x", 1024, 2000)])
    assert not ended.is_set()
    landed.set_result(None)  # the copy back from the device landed: the write starts
    writes.wait()
    assert ended.is_set()
    assert not writes.unsent_to([Region("x", 0, 1)])
    with cv:
        assert not writes.in_flight
    assert torch.equal(store.get("x")[:1024], torch.ones(1024))


def test_a_failed_write_is_raised_once_and_its_end_still_runs(store) -> None:
    writes = WriteBehind(store, threading.Condition())
    landed: Future[None] = Future()
    ended = threading.Event()
    writes.start(landed, {Region("x", 0, 4): torch.ones(4)}, then=ended.set)
    landed.set_exception(RuntimeError("copy failed"))
    writes.wait()
    assert ended.is_set()
    with pytest.raises(RuntimeError, match="copy failed"):
        writes.raise_errors()
    writes.raise_errors()  # raised once


def test_a_write_that_cannot_start_raises_at_once_and_records_nothing(store) -> None:
    cv = threading.Condition()
    writes = WriteBehind(store, cv)
    done: Future[None] = Future()
    done.set_result(None)
    with pytest.raises(ts.errors.KeyNotFoundError):
        writes.start(done, {Region("missing", 0, 4): torch.ones(4)}, then=lambda: None)
    with cv:
        assert not writes.in_flight
    writes.raise_errors()
