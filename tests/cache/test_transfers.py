"""The cache's host <-> device copies go through the engine's transfer layer, and wait for it.

The recording stand-in (:mod:`tests.engine.recording`) plays a GPU on the CPU: a copy to the
"device" runs later on its own thread and the buffer holds NaN until it has, so a cache that did
not wait for its copies would hand out NaN.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from tests.engine.recording import RecordingTransfers
from tierswap import SwapStore, TierCache
from tierswap.cache import tiercache
from tierswap.engine import ToDevice, ToHost


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    transfers = RecordingTransfers(delay=0.002)
    monkeypatch.setattr(tiercache, "transfers_for", lambda device: transfers)
    store = SwapStore(tmp_path / "s", mode="w", durable=False)
    cache = TierCache(store, device_budget="1MiB", host_budget="1MiB", device="cpu")
    yield cache, store, transfers
    cache.close()
    store.close()
    transfers.close()


def _count(transfers: RecordingTransfers, kind: str) -> int:
    return transfers.kinds().count(kind)


def test_device_tier_copies_go_through_the_transfer_layer(recorded) -> None:
    cache, store, transfers = recorded
    value = torch.arange(4096, dtype=torch.float32)
    cache.put("a", value, tier="device")  # a copy of the caller's tensor, into the device tier
    assert _count(transfers, "h2d") == 1
    assert torch.equal(cache.get("a", tier="device"), value)  # waited for: no NaN
    assert torch.equal(cache.get("a", tier="host"), value)  # moved out: a copy back
    assert _count(transfers, "d2h") == 1
    assert _count(transfers, "d2h_done") == 1
    assert torch.equal(cache.get("a", tier="device"), value)  # and in again
    assert _count(transfers, "h2d") == 2
    cache.put("b", value + 1, tier="host")  # host to host: a plain copy, nothing recorded
    assert _count(transfers, "h2d") == 2
    cache.flush()
    store.put("c", value * 3)
    assert torch.equal(cache.get("c", tier="device"), value * 3)  # read from disk, then moved
    assert _count(transfers, "h2d") == 3
    kinds = transfers.kinds()
    assert kinds.count("h2d_done") == kinds.count("h2d")  # every copy ran before it was used


def test_an_update_in_place_of_a_device_entry_waits_for_its_copy(recorded) -> None:
    cache, _store, transfers = recorded
    cache.put("a", torch.zeros(1024), tier="device")
    cache.put("a", torch.full((1024,), 7.0), tier="device")  # same shape: in place
    assert _count(transfers, "h2d") == 2
    assert torch.equal(cache.get("a", tier="device"), torch.full((1024,), 7.0))


class HeldCopies:
    """A transfer layer whose copies land when the test says: each copy's bytes move when it
    is issued; while ``hold`` is set, its future completes (or fails) only when the test
    completes it (:meth:`wait_for_copy` hands it over), else at once."""

    moves = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.hold = False
        self.pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def _issue(self, source: torch.Tensor, dest: torch.Tensor) -> Future[None]:
        dest.copy_(source.view_as(dest))
        future: Future[None] = Future()
        if not self.hold:
            future.set_result(None)
            return future
        with self._lock:
            self.pending.append(future)
        return future

    def to_device(self, host_tensor, device_tensor=None):
        return ToDevice(device_tensor, None, self._issue(host_tensor, device_tensor))

    def ready(self, copy):
        return copy.device_tensor

    def to_host(self, device_tensor, host_tensor=None):
        return ToHost(host_tensor, self._issue(device_tensor, host_tensor))

    def wait_for_copy(self) -> Future[None]:
        while True:
            with self._lock:
                if self.pending:
                    return self.pending.pop(0)
            time.sleep(0.001)


def _fails_with_its_copy(pool, transfers: HeldCopies, call, *args) -> None:
    """``call(*args)`` on ``pool`` raises the failure of the copy it waits for."""
    future = pool.submit(call, *args)
    transfers.wait_for_copy().set_exception(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        future.result(timeout=10)


@pytest.fixture
def held(monkeypatch, tmp_path):
    transfers = HeldCopies()
    monkeypatch.setattr(tiercache, "transfers_for", lambda device: transfers)
    with SwapStore(tmp_path / "s", mode="w", durable=False) as store:
        cache = TierCache(store, device_budget=4096, host_budget=8192, device="cpu")
        yield cache, store, transfers
        cache.close()


def test_a_demotion_copies_outside_the_lock_and_its_bytes_count_until_it_lands(held) -> None:
    cache, _store, transfers = held
    cache.put("a", torch.full((1024,), 1.0), tier="device")  # fills the device tier
    cache.put("b", torch.full((1024,), 2.0), tier="host")
    transfers.hold = True
    with ThreadPoolExecutor(1) as pool:
        # b's move to the device demotes a; its copy to the host is held in flight
        moving = pool.submit(cache.get, "b", "device")
        demotion = transfers.wait_for_copy()
        assert cache.where("a") == "host"  # another call goes on meanwhile: no lock held
        stats = cache.stats()
        assert stats.device.used == 4096  # a's device bytes count until its copy has read them
        assert not moving.done()  # b waits for them
        demotion.set_result(None)
        transfers.wait_for_copy().set_result(None)  # b's copy in
        assert torch.equal(moving.result(timeout=10), torch.full((1024,), 2.0))
    transfers.hold = False
    assert torch.equal(cache.get("a", tier="host"), torch.full((1024,), 1.0))


def test_a_failed_move_puts_the_item_back_and_is_raised_once(held) -> None:
    cache, store, transfers = held
    cache.put("a", torch.full((1024,), 3.0), tier="host")
    transfers.hold = True
    with ThreadPoolExecutor(1) as pool:
        _fails_with_its_copy(pool, transfers, cache.get, "a", "device")
    transfers.hold = False
    assert cache.where("a") == "host"  # back where it was, still dirty: flush writes it
    cache.flush()
    assert torch.equal(store.get("a"), torch.full((1024,), 3.0))
    assert cache.stats().device.used == 0


def test_a_read_into_the_device_tier_ends_with_its_copy_in(held) -> None:
    _cache, store, transfers = held
    store.put("big", torch.arange(3072.0))  # larger than the host budget: read into the device
    with TierCache(store, device_budget=16384, host_budget=0, device="cpu") as direct:
        transfers.hold = True
        with ThreadPoolExecutor(1) as pool:
            _fails_with_its_copy(pool, transfers, direct.get, "big", "device")
            assert direct.where("big") is None
            assert direct.stats().device.used == 0
            reading = pool.submit(direct.get, "big", "device")
            transfers.wait_for_copy().set_result(None)
            assert torch.equal(reading.result(timeout=10), torch.arange(3072.0))
        transfers.hold = False
