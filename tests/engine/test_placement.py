"""The policy chooses what stays resident on a cyclic schedule, tier by tier."""

from __future__ import annotations

import threading

import pytest

from tests.engine.policies import KeepEven, number
from tierswap.engine import LookaheadPolicy, LRUPolicy, kept, place, simulate
from tierswap.errors import ConfigError

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
    placed = place("lookahead", KEYS, SIZES, {"device": 300, "host": 400})
    device = [k for k in KEYS if placed.get(k) == "device"]
    host = [k for k in KEYS if placed.get(k) == "host"]
    assert len(device) == 3  # each tier full, none twice: Belady on each tier's share
    assert len(host) == 4
    assert device[:2] == KEYS[:2]
    assert not set(device) & set(host)


def test_each_tier_replays_its_own_copy_of_a_policy_instance() -> None:
    """20 equal slices, room for 5 on the device and 8 on the host: an instance keeps what the
    name keeps (one shared instance kept 12: the device's replay left it its schedule and
    position, which steered the host's), and the caller's instance is left as it was."""
    keys = [f"s{i}" for i in range(20)]
    sizes = dict.fromkeys(keys, 100)
    capacities = {"device": 500, "host": 800}
    mine = LookaheadPolicy()
    by_name = place("lookahead", keys, sizes, capacities)
    by_instance = place(mine, keys, sizes, capacities)
    assert len(by_name) == 13
    assert by_instance == by_name
    assert mine.schedule is None


def test_a_policy_that_cannot_be_copied_is_refused_clearly() -> None:
    class Locked(KeepEven):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(ConfigError, match="cannot be copied for each tier"):
        place(Locked(), KEYS, SIZES, {"device": 300, "host": 400})
