"""A cache tier's books: an engine ledger, and the views over its bytes with their invariant."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.cache.conftest import LoggingStore
from tierswap import TierCache
from tierswap.cache._tiers import Entry, Meta, Tier, WriteBack
from tierswap.errors import BudgetError

PAGE = 4096


def _tier(pages: int = 3) -> Tier:
    return Tier("host", pages * PAGE, threading.Condition(threading.RLock()), torch.device("cpu"))


def _entry(key: str, pages: int = 1) -> Entry:
    meta = Meta(torch.float32, (pages * PAGE // 4,), pages * PAGE)
    return Entry(key, meta, "host", torch.empty(0))


def test_entries_hold_bytes_the_ledger_reserved() -> None:
    tier = _tier()
    a = _entry("a")
    assert tier.take(a.size, a.key)
    tier.add(a)
    assert (tier.used, tier.ledger.used, tier.resident, tier.free) == (PAGE, PAGE, PAGE, 2 * PAGE)
    assert tier.balanced()
    tier.discard(a)
    assert tier.used == tier.resident == 0
    assert tier.balanced()


def test_a_written_victims_bytes_are_earmarked_then_taken() -> None:
    tier = _tier(pages=2)
    victim = _entry("victim", pages=2)
    assert tier.take(victim.size)
    tier.add(victim)
    assert not tier.take(PAGE, "next")  # full
    tier.start_write(victim, for_key="next")
    assert (tier.writing, tier.promised, tier.used) == (2 * PAGE, {"next": 2 * PAGE}, 2 * PAGE)
    assert tier.coming("next", PAGE)
    assert not tier.coming("other", PAGE)
    tier.end_write(WriteBack(victim, "next"), failed=False, earmark=True)
    assert (tier.writing, tier.promised, tier.earmarks) == (0, {}, {"next": 2 * PAGE})
    assert tier.balanced()
    assert tier.room("other") == 0
    assert tier.room("next") == 2 * PAGE
    assert tier.take(PAGE, "next")  # takes one page of its earmark; the other is freed
    assert (tier.earmarks, tier.used) == ({}, PAGE)


def test_a_failed_write_back_returns_its_entry() -> None:
    tier = _tier()
    victim = _entry("v")
    assert tier.take(victim.size)
    tier.add(victim)
    tier.start_write(victim, for_key=None)
    tier.end_write(WriteBack(victim), failed=True, earmark=False)
    assert dict(tier.entries.items()) == {"v": victim}
    assert tier.balanced()


def test_unwanted_earmarks_go_back_to_the_budget() -> None:
    tier = _tier()
    for key in ("a", "b"):
        victim = _entry(f"v{key}")
        tier.take(victim.size)
        tier.add(victim)
        tier.start_write(victim, for_key=key)
        tier.end_write(WriteBack(victim, key), failed=False, earmark=True)
    assert tier.release_earmarks(lambda key: key == "a")
    assert (tier.earmarks, tier.used) == ({"a": PAGE}, PAGE)
    assert not tier.release_earmarks(lambda key: True)


def test_a_view_beyond_the_ledger_is_caught() -> None:
    tier = _tier()
    with pytest.raises(AssertionError, match="out of balance"):
        tier.add(_entry("a"))  # no bytes reserved for it
    tier = _tier()
    with pytest.raises(AssertionError, match="leaves"):
        tier.ledger.release(PAGE)  # the ledger's own invariant: used >= 0


def test_the_ledger_refuses_bytes_past_the_budget() -> None:
    tier = _tier(pages=1)
    assert tier.take(PAGE)
    assert not tier.take(1)
    assert tier.used == PAGE


def test_the_cache_is_built_on_the_engine(logged: LoggingStore) -> None:
    logged.put("x", torch.arange(10.0))
    with TierCache(logged, device_budget=2 * PAGE, host_budget=2 * PAGE) as cache:
        host = cache.get("x", tier="host")
        assert host.data_ptr() % PAGE == 0  # a page-aligned buffer from engine.allocate
        for tier in cache._tiers.values():
            assert tier.ledger.cv is cache._cv  # one lock for the cache and its ledgers
        stats = cache.stats()
        assert stats.host == cache._tiers["host"].ledger.stats()
        assert (stats.host.used, stats.host.misses, stats.host.bytes_in) == (PAGE, 1, 40)
        cache.get("x", tier="device")
        stats = cache.stats()
        assert (stats.host.used, stats.device.used) == (0, PAGE)
        assert (stats.host.bytes_out, stats.device.bytes_in) == (40, 40)


def test_a_budget_below_zero_is_refused_by_the_ledger() -> None:
    with pytest.raises(BudgetError):
        Tier("host", -1, threading.Condition(threading.RLock()), torch.device("cpu"))
