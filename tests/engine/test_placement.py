"""The policy chooses what stays resident on a cyclic schedule, tier by tier."""

from __future__ import annotations

from tests.engine.policies import KeepEven, number
from tierswap.engine import LookaheadPolicy, LRUPolicy, kept, place, simulate

KEYS = [f"s{i}" for i in range(12)]
SIZES = dict.fromkeys(KEYS, 100)


def test_lookahead_keeps_what_belady_keeps() -> None:
    held = kept(LookaheadPolicy(), KEYS, SIZES, 600)
    assert held == [*KEYS[:5], KEYS[-1]]  # the tier's worth, kept across the whole cycle
    # the reads it leaves are Belady's optimum on the same schedule
    steady = simulate(KEYS, SIZES, 600, cycles=3)[-1]
    assert steady.reads == len(KEYS) - len(held)


def test_lru_keeps_nothing_of_a_cycle_larger_than_the_tier() -> None:
    assert kept(LRUPolicy(), KEYS, SIZES, 600) == []


def test_everything_fits() -> None:
    assert kept(LRUPolicy(), KEYS, SIZES, 1200) == KEYS


def test_a_custom_policy_is_honoured() -> None:
    held = kept(KeepEven(), KEYS, SIZES, 600)
    assert held
    assert all(number(k) % 2 == 0 for k in held)


def test_device_tier_first_then_host() -> None:
    policies = {"device": LookaheadPolicy(), "host": LookaheadPolicy()}
    placed = place(policies, KEYS, SIZES, {"device": 300, "host": 400})
    device = [k for k in KEYS if placed.get(k) == "device"]
    host = [k for k in KEYS if placed.get(k) == "host"]
    assert len(device) == 3  # each tier full, none twice: Belady on each tier's share
    assert len(host) == 4
    assert device[:2] == KEYS[:2]
    assert not set(device) & set(host)
