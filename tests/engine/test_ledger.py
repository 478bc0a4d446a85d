"""The byte ledger: 0 <= used <= budget always, waits only for what can come."""

from __future__ import annotations

import threading

import pytest

from tierswap.engine import Ledger
from tierswap.errors import BudgetError


def test_reserve_and_release_keep_used_within_the_budget() -> None:
    ledger = Ledger("host", 100)
    assert ledger.try_reserve(60)
    assert not ledger.try_reserve(41)  # would pass the budget: refused, nothing changes
    assert (ledger.used, ledger.free) == (60, 40)
    ledger.reserve(40, can_wait=lambda: False)
    assert ledger.free == 0
    ledger.release(70)
    assert (ledger.used, ledger.peak) == (30, 100)


def test_more_than_the_budget_or_nothing_to_wait_for_is_a_budget_error() -> None:
    ledger = Ledger("device", 100)
    with pytest.raises(BudgetError, match="cannot fit the device budget"):
        ledger.reserve(101, can_wait=lambda: True)
    ledger.reserve(80, can_wait=lambda: False)
    with pytest.raises(BudgetError, match="nothing in flight will free them"):
        ledger.reserve(30, can_wait=lambda: False)
    assert ledger.used == 80  # the refused reservations left nothing behind


def test_a_reservation_waits_for_a_release_from_another_thread() -> None:
    ledger = Ledger("host", 100)
    ledger.reserve(90, can_wait=lambda: False)
    reserved = threading.Event()

    def reserve() -> None:
        ledger.reserve(50, can_wait=lambda: True)
        reserved.set()

    waiter = threading.Thread(target=reserve)
    waiter.start()
    assert not reserved.wait(0.1)  # 50 do not fit beside 90
    ledger.release(60)
    assert reserved.wait(10)
    waiter.join()
    assert ledger.used == 80


def test_a_release_of_more_than_was_reserved_is_caught() -> None:
    ledger = Ledger("host", 100)
    ledger.try_reserve(10)
    with pytest.raises(AssertionError, match="leaves"):
        ledger.release(11)
    assert ledger.used == 10


def test_stats_report_what_the_tier_holds_and_served() -> None:
    ledger = Ledger("host", 64)
    ledger.try_reserve(16)
    ledger.hits, ledger.misses, ledger.bytes_in, ledger.bytes_out = 3, 1, 16, 8
    stats = ledger.stats()
    assert (stats.used, stats.budget, stats.hits, stats.misses) == (16, 64, 3, 1)
    assert (stats.bytes_in, stats.bytes_out, stats.peak) == (16, 8, 16)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(BudgetError, match="must be >= 0"):
        Ledger("host", -1)
