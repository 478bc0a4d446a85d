"""The engine's path to the store: write-behind, its errors, and reads ordered after it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.engine import Disk, Region, overlap

PAGE = 4096


@pytest.fixture
def store(tmp_path: Path):
    with ts.SwapStore(tmp_path / "s", chunk_bytes=PAGE) as store:
        store.put("x", torch.zeros(4096))
        yield store


def test_a_write_waits_for_its_copy_and_blocks_reads_of_its_regions(store) -> None:
    cv = threading.Condition()
    disk = Disk(store, cv)
    landed: Future[None] = Future()
    ended: list[BaseException | None] = []
    disk.write({Region("x", 0, 1024): torch.ones(1024)}, after=landed, then=ended.append)
    with cv:
        assert disk.in_flight
    assert disk.unsent_to([Region("x", 1000, 2000)])  # overlaps: a read must wait
    assert not disk.unsent_to([Region("x", 1024, 2000)])
    assert disk.unsent_to(["x"])  # the whole item overlaps every region of it
    assert not ended
    landed.set_result(None)  # the copy back from the device landed: the write starts
    disk.wait()
    assert ended == [None]
    assert not disk.unsent_to([Region("x", 0, 1)])
    with cv:
        assert not disk.in_flight
    assert torch.equal(store.get("x")[:1024], torch.ones(1024))


def test_a_read_waits_for_the_unsent_write_it_overlaps(store) -> None:
    disk = Disk(store, threading.Condition())
    landed: Future[None] = Future()
    disk.write({Region("x", 0, 8): torch.full((8,), 7.0)}, after=landed)
    threading.Timer(0.05, landed.set_result, (None,)).start()
    out = torch.empty(8)
    disk.read(Region("x", 0, 8), out).result()  # waits until the store has the write
    assert torch.equal(out, torch.full((8,), 7.0))
    disk.wait()


def test_a_failed_write_is_raised_once_and_its_end_hears_of_it(store) -> None:
    disk = Disk(store, threading.Condition())
    landed: Future[None] = Future()
    ended: list[BaseException | None] = []
    disk.write({Region("x", 0, 4): torch.ones(4)}, after=landed, then=ended.append)
    landed.set_exception(RuntimeError("copy failed"))
    disk.wait()
    assert len(ended) == 1
    assert isinstance(ended[0], RuntimeError)
    with pytest.raises(RuntimeError, match="copy failed"):
        disk.raise_errors()
    disk.raise_errors()  # raised once


def test_a_write_that_cannot_start_is_a_failed_write_after_the_others_ended(store) -> None:
    cv = threading.Condition()
    disk = Disk(store, cv)
    ended: list[BaseException | None] = []
    writes = {Region("x", 0, 4): torch.ones(4), Region("missing", 0, 4): torch.ones(4)}
    disk.write(writes, then=ended.append)
    disk.wait()
    assert len(ended) == 1
    assert isinstance(ended[0], ts.errors.KeyNotFoundError)
    with cv:
        assert not disk.in_flight
    with pytest.raises(ts.errors.KeyNotFoundError):
        disk.raise_errors()
    assert torch.equal(store.get("x")[:4], torch.ones(4))  # the write that started ended


def test_whole_items_are_written_and_read_as_one(store) -> None:
    disk = Disk(store, threading.Condition())
    disk.write({"y": torch.arange(6.0).view(2, 3)})
    disk.wait()
    disk.raise_errors()
    assert disk.read("y").result().shape == (2, 3)
    disk.put("y", torch.ones(3))  # a write-through replaces the item, shape and all
    traffic = disk.traffic()
    assert traffic["bytes_written"] == 6 * 4 + 3 * 4
    assert traffic["bytes_read"] == 6 * 4
    assert torch.equal(store.get("y"), torch.ones(3))


def test_overlap() -> None:
    assert overlap(Region("a", 0, 4), Region("a", 3, 5))
    assert not overlap(Region("a", 0, 4), Region("a", 4, 5))
    assert not overlap(Region("a", 0, 4), Region("b", 0, 4))
    assert overlap("a", Region("a", 9, 10))
    assert not overlap("a", "b")


def test_a_write_is_in_flight_until_its_then_has_run(store) -> None:
    """``wait`` returns, and ``in_flight`` turns false, only once each write's ``then`` has
    run: a front end that waits for its writes finds their bytes and buffers given back."""
    cv = threading.Condition()
    disk = Disk(store, cv)
    entered, go = threading.Event(), threading.Event()
    ended: list[BaseException | None] = []

    def then(error: BaseException | None) -> None:
        entered.set()
        assert go.wait(5)
        ended.append(error)

    disk.write({Region("x", 0, 4): torch.ones(4)}, then=then)
    assert entered.wait(5)  # the store has the write; its then runs
    with cv:
        assert disk.in_flight
    waiter = threading.Thread(target=disk.wait)
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()
    go.set()
    waiter.join(5)
    assert ended == [None]
    with cv:
        assert not disk.in_flight


class HeldWrites:
    """A store whose region writes reach the real store only once ``release`` is set: until
    then they are in flight."""

    def __init__(self, store: ts.SwapStore, *, fail: bool = False) -> None:
        self._store = store
        self.release = threading.Event()
        self.fail = fail  # once released, the writes fail instead of reaching the store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        done: Future[None] = Future()

        def write() -> None:
            self.release.wait(5)
            if self.fail:
                done.set_exception(OSError(5, "Input/output error"))
                return
            self._store.put_region_async(key, start, tensor).result()
            done.set_result(None)

        threading.Thread(target=write).start()
        return done


def test_a_read_that_a_write_in_flight_holds_is_copied_from_it(store) -> None:
    """While a write is in flight, a read of bytes it holds whole is copied from its tensor
    (the store reads nothing, ``bytes_forwarded`` counts it); a read it holds in part, and
    any read after it ended, goes to the store."""
    held = HeldWrites(store)
    disk = Disk(held, threading.Condition())
    disk.write({Region("x", 0, 1024): torch.arange(1024.0)})
    before = disk.traffic()
    out = torch.empty(100)
    assert disk.read(Region("x", 100, 200), out).result() is out
    assert torch.equal(out, torch.arange(100.0, 200.0))
    traffic = disk.traffic()
    assert traffic["bytes_forwarded"] == 400
    assert traffic["bytes_read"] == before["bytes_read"]
    disk.read(Region("x", 1000, 1100), torch.empty(100)).result()  # in part: the store
    assert disk.traffic()["bytes_read"] > before["bytes_read"]
    assert disk.traffic()["bytes_forwarded"] == 400
    held.release.set()
    disk.wait()
    disk.read(Region("x", 100, 200), out).result()
    assert torch.equal(out, torch.arange(100.0, 200.0))  # from the store now
    assert disk.traffic()["bytes_forwarded"] == 400


def test_a_read_copied_from_a_write_that_then_fails_leaves_the_failure_to_raise(store) -> None:
    """A read copied from a write in flight holds values the store never gets when that write
    fails. Nothing is lost silently: the failure is kept and raised once (the front ends raise
    it before a commit), and a read after it gets what the store holds."""
    held = HeldWrites(store, fail=True)
    disk = Disk(held, threading.Condition())
    ended: list[BaseException | None] = []
    disk.write({Region("x", 0, 8): torch.full((8,), 2.0)}, then=ended.append)
    out = disk.read(Region("x", 0, 4), torch.empty(4)).result()
    assert torch.equal(out, torch.full((4,), 2.0))  # copied from the write
    held.release.set()
    disk.wait()
    assert isinstance(ended[0], OSError)
    with pytest.raises(OSError, match="Input/output error"):
        disk.raise_errors()
    assert torch.equal(disk.read(Region("x", 0, 4)).result(), torch.zeros(4))  # the store's


def test_the_newest_write_that_overlaps_a_read_decides(store) -> None:
    """Of two writes in flight over the same bytes, a read copies the newer one's; where the
    newest overlapping write holds the read in part, the read is not copied from an older one
    that holds it whole."""
    held = HeldWrites(store)
    disk = Disk(held, threading.Condition())
    disk.write({Region("x", 0, 8): torch.full((8,), 1.0)})
    disk.write({Region("x", 0, 8): torch.full((8,), 2.0)})
    out = torch.empty(4)
    disk.read(Region("x", 0, 4), out).result()
    assert torch.equal(out, torch.full((4,), 2.0))
    disk.write({Region("x", 6, 12): torch.full((6,), 3.0)})
    disk.read(Region("x", 4, 8), torch.empty(4)).result()  # the newest holds it in part
    assert disk.traffic()["bytes_forwarded"] == 16
    held.release.set()
    disk.wait()


def test_a_write_does_not_end_while_a_read_copies_from_it(
    store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write's ``then`` (which gives its buffers back for reuse) runs only once a read that
    copies from its tensor has finished copying."""
    held = HeldWrites(store)
    disk = Disk(held, threading.Condition())
    ended: list[BaseException | None] = []
    disk.write({Region("x", 0, 8): torch.full((8,), 5.0)}, then=ended.append)
    copying, finish = threading.Event(), threading.Event()
    copy = torch.Tensor.copy_

    def slow_copy(self: torch.Tensor, source: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        copying.set()
        assert finish.wait(5)
        return copy(self, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", slow_copy)
    out = torch.empty(8)
    reader = threading.Thread(target=lambda: disk.read(Region("x", 0, 8), out).result())
    reader.start()
    assert copying.wait(5)
    held.release.set()  # the store has the write
    reader.join(0.1)
    assert not ended  # its end waits for the copy
    finish.set()
    reader.join(5)
    monkeypatch.undo()
    disk.wait()
    assert ended == [None]
    assert torch.equal(out, torch.full((8,), 5.0))


def test_a_write_through_waits_for_the_writes_of_its_item_in_flight(store) -> None:
    """``put`` writes after the writes of the item still in flight, so that no read copies an
    older value from one of them, and the store ends with the put's value."""
    held = HeldWrites(store)
    disk = Disk(held, threading.Condition())
    disk.write({Region("x", 0, 8): torch.full((8,), 1.0)})
    putter = threading.Thread(target=disk.put, args=("x", torch.full((4096,), 9.0)))
    putter.start()
    putter.join(0.1)
    assert putter.is_alive()  # the region's write is in flight
    held.release.set()
    putter.join(5)
    assert not putter.is_alive()
    assert torch.equal(disk.read("x").result(), torch.full((4096,), 9.0))
    disk.wait()
