"""The cache's host <-> device copies go through the engine's transfer layer, and wait for it.

The recording stand-in (:mod:`tests.engine.recording`) plays a GPU on the CPU: a copy to the
"device" runs later on its own thread and the buffer holds NaN until it has, so a cache that did
not wait for its copies would hand out NaN.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.recording import RecordingTransfers
from tierswap import SwapStore, TierCache
from tierswap.cache import tiercache


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
