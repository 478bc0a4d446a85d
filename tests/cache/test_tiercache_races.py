"""Races between a cache's puts and gets of one key, and what a returned tensor is."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

from tests.cache.conftest import LoggingStore
from tierswap import TierCache


def test_a_get_during_a_write_through_put_reads_the_new_value(logged: LoggingStore) -> None:
    logged.put("x", torch.ones(4))
    entered, release = threading.Event(), threading.Event()

    def hold_writes(kind: str, _key: str) -> None:
        if kind == "write":
            entered.set()
            release.wait(10)

    with TierCache(logged, device_budget=0, host_budget="1MiB") as cache:
        logged.on_io = hold_writes  # the put has updated the cache and not yet reached the store
        writer = threading.Thread(target=cache.put, args=("x", torch.arange(8.0), "nvme"))
        writer.start()
        assert entered.wait(5)
        logged.on_io = None
        got: dict[str, Any] = {}

        def read() -> None:
            try:
                got["value"] = cache.get("x", tier="host").clone()
            except Exception as exc:
                got["value"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.3)
        release.set()
        writer.join(10)
        reader.join(10)
        assert not writer.is_alive()
        assert not reader.is_alive()
        assert isinstance(got["value"], torch.Tensor), got["value"]
        assert torch.equal(got["value"], torch.arange(8.0))


def test_a_failed_write_through_put_leaves_the_old_value_readable(store: Any) -> None:
    store.put("x", torch.ones(4))

    class Failing(LoggingStore):
        def put(self, key: str, tensor: torch.Tensor) -> None:
            raise OSError(28, "No space left on device")

    with TierCache(Failing(store), device_budget=0, host_budget="1MiB") as cache:
        with contextlib.suppress(OSError):
            cache.put("x", torch.arange(8.0), tier="nvme")
        assert torch.equal(cache.get("x", tier="host"), torch.ones(4))


def test_a_failed_write_through_put_keeps_a_value_not_yet_written_down(store: Any) -> None:
    """The cached value of a dirty key is newer than the store's (or the store has none): a
    failed write-through keeps it, cached and dirty, instead of falling back to the store."""
    store.put("x", torch.ones(4))

    class Failing(LoggingStore):
        def put(self, key: str, tensor: torch.Tensor) -> None:
            raise OSError(28, "No space left on device")

    with TierCache(Failing(store), device_budget=0, host_budget="1MiB") as cache:
        cache.put("x", torch.full((3,), 2.0), tier="host")  # dirty: the store holds ones(4)
        cache.put("new", torch.full((2,), 5.0), tier="host")  # dirty: not in the store
        for key in ("x", "new"):
            with pytest.raises(OSError, match="No space"):
                cache.put(key, torch.arange(8.0), tier="nvme")
        assert torch.equal(cache.get("x", tier="host"), torch.full((3,), 2.0))
        assert torch.equal(cache.get("new", tier="host"), torch.full((2,), 5.0))
        assert cache.stats().host.used == 2 * 4096
        cache.flush()
    assert torch.equal(store.get("x"), torch.full((3,), 2.0))
    assert torch.equal(store.get("new"), torch.full((2,), 5.0))


def test_a_get_that_waited_for_a_failed_write_through_reads_the_old_value(store: Any) -> None:
    """A get of a key being written through waits for the write; when it fails, the get reads
    the value the store still holds (it raised a bare KeyError: the key's shape was gone)."""
    store.put("x", torch.ones(4))
    release = threading.Event()

    class Failing(LoggingStore):
        def put(self, key: str, tensor: torch.Tensor) -> None:
            release.wait(30)
            raise OSError(28, "No space left on device")

    got: dict[str, Any] = {}

    def read() -> None:
        try:
            got["value"] = cache.get("x", tier="host")
        except BaseException as exc:
            got["value"] = exc

    def write() -> None:
        with contextlib.suppress(OSError):
            cache.put("x", torch.arange(8.0), tier="nvme")

    with TierCache(Failing(store), device_budget=0, host_budget="1MiB") as cache:
        writer = threading.Thread(target=write)
        writer.start()
        while "x" not in cache._core.write_backs:  # white-box: the write-through has begun
            threading.Event().wait(0.005)
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.2)  # the reader waits for the write
        release.set()
        writer.join(10)
        reader.join(10)
        assert not reader.is_alive()
        assert isinstance(got["value"], torch.Tensor), got["value"]
        assert torch.equal(got["value"], torch.ones(4))


def test_a_host_get_returns_the_cached_buffer_that_a_same_shape_put_updates(store: Any) -> None:
    """Pinned, documented behaviour: ``get`` at the host tier returns the cache's buffer, no
    copy; a later put of the same shape writes into it. Callers who keep a value clone it."""
    with TierCache(store, device_budget=0, host_budget="1MiB") as cache:
        cache.put("k", torch.ones(4), tier="host")
        held = cache.get("k", tier="host")
        kept = held.clone()
        cache.put("k", torch.zeros(4), tier="host")
        assert torch.equal(held, torch.zeros(4))  # the buffer changed under the caller
        assert torch.equal(kept, torch.ones(4))
        cache.put("k", torch.zeros(5), tier="host")  # another shape: a new buffer
        assert torch.equal(held, torch.zeros(4))


def test_a_prefetch_does_not_move_an_item_being_pinned(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between finding a key's entry and pinning it (or returning its tensor) a call releases the
    lock; a prefetch then moved the entry to the other tier, and the caller got the new buffer
    before the copy filled it: a change made under the pin was lost when the copy landed, a get
    returned stale bytes (both seen in the many-threads test). The prefetch now waits while the
    entry is held."""
    store.put("x", torch.zeros(1024))
    with TierCache(store, device_budget="1MiB", host_budget="1MiB") as cache:
        cache.get("x", tier="host")
        drain = cache._gate.drain  # white-box: the lock released, the entry held, not pinned yet
        asked: list[str] = []

        def drain_then_prefetch() -> None:
            drain()
            if not asked and threading.current_thread() is threading.main_thread():
                asked.append("x")
                cache.prefetch(["x"], tier="device")

        monkeypatch.setattr(cache._gate, "drain", drain_then_prefetch)
        with cache.pinned("x", tier="host", dirty=True) as t:
            assert cache.where("x") == "host"
            t.add_(1)
        assert asked == ["x"]
        monkeypatch.undo()
        cache.flush()
    assert torch.equal(store.get("x"), torch.ones(1024))
