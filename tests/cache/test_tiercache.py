"""Conformance suite: every policy runs every test here, against a real SwapStore."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tierswap import LookaheadPolicy, LRUPolicy, TierCache
from tierswap.cache._core import CacheCore
from tierswap.errors import (
    BudgetError,
    ConfigError,
    InvalidKeyError,
    InvalidTensorError,
    KeyNotFoundError,
    OutOfSpaceError,
    PinnedError,
    StoreClosedError,
)

from .conftest import LoggingStore

PAGE = 4096
ITEM = PAGE // 4  # float32 elements in one page
KEYS = [f"layer{i}/w" for i in range(6)]

POLICIES: dict[str, Callable[[], Any]] = {
    "lru": lambda: "lru",
    "lookahead": lambda: "lookahead",
    "LRUPolicy": LRUPolicy,
    "LookaheadPolicy-scheduled": lambda: LookaheadPolicy(schedule=KEYS),
}


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> Any:
    return POLICIES[request.param]()


def value(i: int, n: int = ITEM) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000 * i


@pytest.fixture
def filled(logged: LoggingStore) -> LoggingStore:
    for i, key in enumerate(KEYS):
        logged.put(key, value(i))
    logged.log.clear()
    return logged


@pytest.fixture
def make(filled: LoggingStore, policy: Any) -> Iterator[Callable[..., TierCache]]:
    caches: list[TierCache] = []

    def factory(**kw: Any) -> TierCache:
        kw.setdefault("device_budget", 0)
        kw.setdefault("host_budget", 3 * PAGE)
        cache = TierCache(filled, policy=policy, **kw)
        caches.append(cache)
        return cache

    yield factory
    for cache in caches:
        cache.close()


def test_get_returns_stored_values(make: Callable[..., TierCache]) -> None:
    cache = make()
    for _ in range(2):
        for i, key in enumerate(KEYS):
            torch.testing.assert_close(cache.get(key, tier="host"), value(i))
            assert cache.stats().host.used <= 3 * PAGE


def test_host_get_returns_the_cached_buffer_itself(make: Callable[..., TierCache]) -> None:
    cache = make(host_budget=len(KEYS) * PAGE)
    first = cache.get(KEYS[0], tier="host")
    assert cache.get(KEYS[0], tier="host").data_ptr() == first.data_ptr()
    assert first.data_ptr() % PAGE == 0
    with cache.pinned(KEYS[0], tier="host") as held:
        assert held.data_ptr() == first.data_ptr()


def test_put_then_get(make: Callable[..., TierCache]) -> None:
    cache = make()
    t = torch.randn(3, 5, dtype=torch.float64)
    cache.put("new/x", t, tier="host")
    t.add_(1)  # the cache holds a copy
    torch.testing.assert_close(cache.get("new/x", tier="host"), t - 1)
    assert cache.get("new/x", tier="host").shape == (3, 5)


@pytest.mark.parametrize("tier", ["device", "host"])
def test_put_of_a_stepped_parameter_view_with_grad_mode_on(
    make: Callable[..., TierCache], tier: str
) -> None:
    """A view of a parameter made under ``no_grad`` whose base a step then changed in place:
    torch refuses any recorded use of it, and a training loop puts it with grad mode on. The
    cache copies it without autograd, into either tier, and again in place."""
    cache = make(device_budget=3 * PAGE)
    param = torch.nn.Parameter(torch.arange(2 * ITEM, dtype=torch.float32))
    with torch.no_grad():
        view = param.view(-1)[:ITEM]
        param.mul_(2)
    for _ in range(2):  # the second put of the same shape writes into the cached buffer
        cache.put("p/view", view, tier=tier)
        assert torch.equal(
            cache.get("p/view", tier=tier), 2 * torch.arange(ITEM, dtype=torch.float32)
        )
        assert cache.get("p/view", tier=tier).grad_fn is None


def test_a_put_whose_copy_fails_takes_no_room(
    make: Callable[..., TierCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes reserved for a put go back when its copy fails: the tier's books balance, and
    the cache closes cleanly and works on."""
    cache = make()

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy failed")

    with monkeypatch.context() as patch:
        patch.setattr(CacheCore, "start_copy", failing)
        with pytest.raises(RuntimeError, match="copy failed"):
            cache.put("new/x", torch.ones(ITEM), tier="host")
    assert cache.stats().host.used == 0
    assert cache.where("new/x") is None
    cache.put("new/x", torch.ones(ITEM), tier="host")
    assert torch.equal(cache.get("new/x", tier="host"), torch.ones(ITEM))


def test_dirty_item_is_written_down_on_eviction(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=PAGE)
    with cache.pinned(KEYS[0], tier="host") as t:
        t.fill_(7.0)
        cache.mark_dirty(KEYS[0])
    cache.get(KEYS[1], tier="host")  # evicts KEYS[0]
    cache.flush()
    assert ("write", KEYS[0]) in filled.log
    torch.testing.assert_close(filled.get(KEYS[0]), torch.full((ITEM,), 7.0))
    torch.testing.assert_close(cache.get(KEYS[0], tier="host"), torch.full((ITEM,), 7.0))


def test_clean_item_is_dropped_without_io(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=PAGE)
    for key in KEYS:
        cache.get(key, tier="host")
    cache.flush()
    assert [kind for kind, _ in filled.log] == ["read"] * len(KEYS)
    assert cache.stats().nvme_bytes_written == 0


def test_pinned_dirty_flag_marks_on_exit(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=PAGE)
    with cache.pinned(KEYS[2], tier="host", dirty=True) as t:
        t.zero_()
    cache.evict(KEYS[2])
    assert cache.where(KEYS[2]) is None
    torch.testing.assert_close(filled.get(KEYS[2]), torch.zeros(ITEM))


def test_flush_then_commit_holds_latest_values(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=2 * PAGE)
    for i, key in enumerate(KEYS):
        cache.put(key, value(i) * -1, tier="host")
    cache.flush()
    filled.commit()
    for i, key in enumerate(KEYS):
        torch.testing.assert_close(filled.get(key), value(i) * -1)
    assert cache.stats().nvme_bytes_written == len(KEYS) * PAGE


def test_put_same_shape_updates_in_place(make: Callable[..., TierCache]) -> None:
    cache = make()
    held = cache.get(KEYS[0], tier="host")
    cache.put(KEYS[0], torch.ones(ITEM), tier="host")
    assert cache.get(KEYS[0], tier="host").data_ptr() == held.data_ptr()
    torch.testing.assert_close(held, torch.ones(ITEM))


def test_put_new_shape_replaces(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    cache = make()
    cache.get(KEYS[0], tier="host")
    cache.put(KEYS[0], torch.ones(2, 2, dtype=torch.int64), tier="host")
    assert cache.get(KEYS[0], tier="host").dtype == torch.int64
    cache.flush()
    torch.testing.assert_close(filled.get(KEYS[0]), torch.ones(2, 2, dtype=torch.int64))


def test_delete_removes_everywhere(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    cache = make()
    cache.get(KEYS[0], tier="host")
    cache.delete(KEYS[0])
    assert KEYS[0] not in filled
    assert KEYS[0] not in cache
    with pytest.raises(KeyNotFoundError):
        cache.get(KEYS[0])
    with pytest.raises(KeyNotFoundError):
        cache.delete(KEYS[0])
    cache.put("only/cached", torch.ones(3), tier="host")
    cache.delete("only/cached")  # never reached the store: no error
    assert "only/cached" not in cache


def test_delete_frees_the_room_set_aside_for_the_keys_read(
    make: Callable[..., TierCache],
) -> None:
    """A written victim's bytes earmarked for a queued read of the key go back to the budget
    when the key is deleted, at once (not when the pump next plans)."""
    cache = make(device_budget=0, host_budget=3 * PAGE)
    host = cache._tiers["host"]
    with cache._cv:  # white-box, and the pump cannot plan meanwhile: the state a write-back
        assert host.ledger.try_reserve(PAGE)  # for a queued prefetch of the key leaves
        host.earmarks[KEYS[0]] = PAGE
        cache._prefetch.add([KEYS[0]], "host")
        cache.delete(KEYS[0])
        assert (host.earmarks, host.used) == ({}, 0)


def test_evict_writes_dirty_and_frees(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    cache = make()
    cache.put("p/q", torch.full((ITEM,), 3.0), tier="host")
    assert cache.stats().host.used == PAGE
    cache.evict("p/q")
    assert cache.stats().host.used == 0
    torch.testing.assert_close(filled.get("p/q"), torch.full((ITEM,), 3.0))
    cache.evict("p/q")  # not cached: nothing to do


def test_missing_key(make: Callable[..., TierCache]) -> None:
    cache = make()
    with pytest.raises(KeyNotFoundError):
        cache.get("nope")
    with pytest.raises(KeyNotFoundError):
        cache.prefetch(["nope"])
    with pytest.raises(KeyNotFoundError, match="pinned"):
        cache.mark_dirty(KEYS[0])  # not resident
    assert cache.stats().host.used == 0


def test_bad_input_leaves_state_unchanged(make: Callable[..., TierCache]) -> None:
    cache = make()
    with pytest.raises(InvalidKeyError):
        cache.put("../x", torch.ones(2))
    with pytest.raises(InvalidTensorError):
        cache.put("x", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tier="):
        cache.get(KEYS[0], tier="gpu")  # type: ignore[arg-type]
    assert cache.stats().host.used == 0


def test_pinned_items_are_never_evicted(make: Callable[..., TierCache]) -> None:
    cache = make(host_budget=2 * PAGE)
    with cache.pinned(KEYS[0], tier="host") as t:
        for key in KEYS[1:]:
            cache.get(key, tier="host")
        assert cache.where(KEYS[0]) == "host"
        torch.testing.assert_close(t, value(0))
        with pytest.raises(PinnedError):
            cache.evict(KEYS[0])
        with pytest.raises(PinnedError):
            cache.delete(KEYS[0])


def test_pinning_more_than_fits_raises(make: Callable[..., TierCache]) -> None:
    cache = make(host_budget=2 * PAGE)
    with cache.pinned(KEYS[0], tier="host"), cache.pinned(KEYS[1], tier="host"):
        with pytest.raises(BudgetError, match="pinned"):
            cache.get(KEYS[2], tier="host")
        assert cache.stats().host.used == 2 * PAGE
    cache.get(KEYS[2], tier="host")  # fine once unpinned


def test_item_larger_than_a_tier(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    """The documented choice: automatic placement skips the tier, naming it raises."""
    cache = make(host_budget=PAGE, device_budget=4 * PAGE)
    big = torch.ones(3 * ITEM)
    with pytest.raises(BudgetError, match="host budget"):
        cache.put("big", big, tier="host")
    cache.put("big", big)  # tier=None: skips host, lands on the device tier
    assert cache.where("big") == "device"
    huge = torch.ones(8 * ITEM)
    cache.put("huge", huge)  # fits no tier: written straight to the store
    assert cache.where("huge") is None
    torch.testing.assert_close(filled.get("huge"), huge)
    with pytest.raises(BudgetError, match="fits neither"):
        cache.get("huge")
    cache.prefetch(["huge"], tier="host")  # skipped, not an error
    assert cache.where("huge") is None
    assert cache.stats().host.used <= PAGE


def test_device_tier_paths(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    cache = make(device_budget=2 * PAGE, host_budget=2 * PAGE)
    t = cache.get(KEYS[0])  # tier=None: the device tier when it is on
    assert cache.where(KEYS[0]) == "device"
    assert t.device == cache.device
    torch.testing.assert_close(t.cpu(), value(0))
    for i, key in enumerate(KEYS[1:4], start=1):
        torch.testing.assert_close(cache.get(key, tier="device").cpu(), value(i))
    stats = cache.stats()
    assert stats.device.used <= 2 * PAGE
    assert stats.host.used <= 2 * PAGE
    torch.testing.assert_close(cache.get(KEYS[1], tier="host"), value(1))  # moves down
    with cache.pinned(KEYS[3], tier="device", dirty=True) as d:
        d.mul_(2)
    cache.flush()
    torch.testing.assert_close(filled.get(KEYS[3]), value(3) * 2)


def test_device_tier_off(make: Callable[..., TierCache]) -> None:
    cache = make(device_budget=0)
    assert cache.get(KEYS[0]).device.type == "cpu"
    assert cache.where(KEYS[0]) == "host"
    with pytest.raises(BudgetError, match="device budget"):
        cache.get(KEYS[0], tier="device")


def test_prefetch_returns_at_once_and_get_waits_for_that_item(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=4 * PAGE)
    cache.get(KEYS[3], tier="host")  # resident before the gate closes
    gate = threading.Event()
    filled.gate = gate
    cache.prefetch(KEYS[:2], tier="host")  # held in flight by the gate; must not block
    assert cache.where(KEYS[0]) == "host"
    torch.testing.assert_close(cache.get(KEYS[3], tier="host"), value(3))  # no wait for others
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    torch.testing.assert_close(cache.get(KEYS[0], tier="host"), value(0))
    timer.join()
    stats = cache.stats()
    assert stats.stall_seconds > 0
    assert stats.host.hits >= 2
    assert filled.reads().count(KEYS[0]) == 1


def test_budget_holds_while_prefetches_are_in_flight(
    make: Callable[..., TierCache], filled: LoggingStore
) -> None:
    cache = make(host_budget=2 * PAGE)
    seen: list[int] = []
    filled.on_io = lambda kind, key: seen.append(cache._tiers["host"].used)
    for cycle in range(3):
        cache.prefetch(KEYS, tier="host")
        for i, key in enumerate(KEYS):
            with cache.pinned(key, tier="host", dirty=True) as t:
                torch.testing.assert_close(t, value(i) + cycle)
                t.add_(1)
    cache.flush()
    assert seen
    assert max(seen) <= 2 * PAGE


class FailingWrites(LoggingStore):
    """A store whose writes fail with ENOSPC while ``full`` is set."""

    full = True

    def put_async(self, key: str, tensor: torch.Tensor) -> Any:
        if self.full:
            raise OutOfSpaceError(f"no space for {key!r}")
        return super().put_async(key, tensor)


def test_failed_write_back_keeps_data_and_reports(filled: LoggingStore, policy: Any) -> None:
    store = FailingWrites(filled)
    cache = TierCache(store, device_budget=0, host_budget=PAGE, policy=policy)
    cache.put("a", torch.full((ITEM,), 5.0), tier="host")
    with pytest.raises(OutOfSpaceError):
        cache.put("b", torch.full((ITEM,), 6.0), tier="host")  # evicting a fails
    assert cache.where("a") == "host"  # kept, still dirty
    with pytest.raises(OutOfSpaceError) as info:
        cache.flush()
    assert info.value.errno == errno.ENOSPC
    store.full = False
    cache.flush()
    torch.testing.assert_close(filled.get("a"), torch.full((ITEM,), 5.0))
    store.full = True
    cache.put("a", torch.zeros(ITEM), tier="host")
    with pytest.raises(OutOfSpaceError):
        cache.close()  # close() flushes, and the disk is still full
    with pytest.raises(StoreClosedError):
        cache.get("a")


def test_a_put_that_fails_leaves_the_key_its_shape(filled: LoggingStore) -> None:
    """A put that raises (here: the write-back it waited for failed) changes nothing, not even
    the shape the cache reads the key with from the store."""
    store = FailingWrites(filled)
    store.full = False
    cache = TierCache(store, device_budget=0, host_budget=PAGE, policy="lru")
    cache.put("b", torch.full((ITEM,), 6.0), tier="host")  # dirty, fills the tier
    store.full = True
    with pytest.raises(OutOfSpaceError):
        cache.put(KEYS[0], torch.zeros(2), tier="host")  # evicting b fails
    store.full = False
    torch.testing.assert_close(cache.get(KEYS[0], tier="host"), value(0))
    cache.close()


def test_a_put_that_fails_keeps_the_value_it_would_replace(filled: LoggingStore) -> None:
    """A put that cannot update a dirty item in place (another shape) and then raises leaves
    the key its value: the store does not have it yet, so dropping it would lose it."""
    store = FailingWrites(filled)
    store.full = False
    cache = TierCache(store, device_budget=0, host_budget=2 * PAGE, policy="lru")
    cache.put("a", torch.full((ITEM,), 5.0), tier="host")  # dirty, not in the store
    cache.put("b", torch.full((ITEM,), 6.0), tier="host")  # dirty; the tier is full
    store.full = True
    with pytest.raises(OutOfSpaceError):
        cache.put("a", torch.zeros(2 * ITEM), tier="host")  # needs b's room too
    store.full = False
    torch.testing.assert_close(cache.get("a", tier="host"), torch.full((ITEM,), 5.0))
    cache.close()
    torch.testing.assert_close(filled.get("a"), torch.full((ITEM,), 5.0))


def test_closed_cache_refuses_calls(make: Callable[..., TierCache]) -> None:
    cache = make()
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(StoreClosedError):
        cache.get(KEYS[0])
    with pytest.raises(StoreClosedError):
        cache.put("x", torch.ones(1))


def test_stats_counts(make: Callable[..., TierCache], filled: LoggingStore) -> None:
    filled.put("s/x", torch.ones(ITEM))  # outside any schedule: no read-ahead
    cache = make(host_budget=len(KEYS) * PAGE)
    cache.get("s/x", tier="host")
    cache.get("s/x", tier="host")
    d = cache.stats().as_dict()
    assert d["host"] == {
        "hits": 1, "misses": 1, "used": PAGE, "budget": len(KEYS) * PAGE,
        "bytes_in": ITEM * 4, "bytes_out": 0, "peak": PAGE,
    }  # fmt: skip
    assert d["nvme"]["bytes_read"] == PAGE
    assert d["nvme"]["bytes_written"] == 0
    assert set(d) == {"device", "host", "nvme", "stall_seconds"}
    assert "TierCache(" in repr(cache)


def test_moving_a_pinned_item_waits_for_other_threads(make: Callable[..., TierCache]) -> None:
    cache = make(device_budget=2 * PAGE, host_budget=2 * PAGE)
    pinned, release = threading.Event(), threading.Event()

    def holder() -> None:
        with cache.pinned(KEYS[0], tier="host"):
            pinned.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    assert pinned.wait(30)
    timer = threading.Timer(0.05, release.set)
    timer.start()
    torch.testing.assert_close(cache.get(KEYS[0], tier="device").cpu(), value(0))  # waits
    assert release.is_set()
    assert cache.where(KEYS[0]) == "device"
    thread.join()
    timer.join()
    with cache.pinned(KEYS[1], tier="host"), pytest.raises(PinnedError, match="until unpinned"):
        cache.get(KEYS[1], tier="device")  # only this thread could unpin it: no deadlock
