from __future__ import annotations

import pytest

from tierswap import LookaheadPolicy, LRUPolicy
from tierswap.engine.policies import EvictionPolicy, make_policy
from tierswap.errors import ConfigError


def test_make_policy_by_name_and_instance() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lookahead"), LookaheadPolicy)
    mine = LookaheadPolicy(schedule=["a", "b"])
    assert make_policy(mine) is mine
    assert isinstance(mine, EvictionPolicy)


@pytest.mark.parametrize("bad", ["fifo", 3, object()])
def test_make_policy_rejects_unknown(bad: object) -> None:
    with pytest.raises(ConfigError, match="policy="):
        make_policy(bad)  # type: ignore[arg-type]


def test_lru_evicts_least_recently_touched() -> None:
    lru = LRUPolicy()
    for key in ["a", "b", "c"]:
        lru.access(key)
    lru.access("a")
    assert lru.victim(["a", "b", "c"], None) == "b"
    assert lru.victim([], None) is None
    assert list(lru.upcoming()) == []


def test_lru_prefetch_only_evicts_older_items() -> None:
    lru = LRUPolicy()
    for key in ["a", "b"]:
        lru.access(key)
    lru.admit("c")  # a prefetch counts as a touch: anything older may go
    assert lru.victim(["a", "b"], "c") == "a"
    lru.access("z")
    assert lru.victim(["z"], "c") is None  # z is newer than c: evicting it would do harm


def test_lru_forget() -> None:
    lru = LRUPolicy()
    lru.access("a")
    lru.access("b")
    lru.forget("a")
    assert lru.victim(["a", "b"], None) == "a"  # unknown keys rank as oldest


def test_lookahead_next_use_and_upcoming() -> None:
    la = LookaheadPolicy(schedule=["a", "b", "c", "d"])
    la.access("b")
    assert la.next_use("c") == 1
    assert la.next_use("a") == 3
    assert la.next_use("b") == 4
    assert la.next_use("zzz") == float("inf")
    assert list(la.upcoming()) == ["c", "d", "a"]


def test_lookahead_demand_victim_is_furthest_next_use() -> None:
    la = LookaheadPolicy(schedule=["a", "b", "c", "d", "e"])
    la.access("a")
    assert la.victim(["b", "c", "d"], None) == "d"
    assert la.victim(["b", "zzz"], None) == "zzz"  # never used again


def test_lookahead_prefetch_victim_is_beladys_choice_at_use_time() -> None:
    la = LookaheadPolicy(schedule=["a", "b", "c", "d", "e"])
    la.access("a")
    # Prefetching d (used in 3 steps): Belady at d's use evicts c (just used then, next use 7
    # steps later), but c is needed before d, so prefetching now would do harm: wait.
    assert la.victim(["a", "b", "c"], "d") is None
    la.access("b")
    la.access("c")
    assert la.victim(["a", "b", "c"], "d") == "c"
    # e's prefetch may evict a only if nothing resident is needed later than at e's use.
    assert la.victim(["a", "b"], "e") == "b"


def test_lookahead_repeated_keys_in_schedule() -> None:
    la = LookaheadPolicy(schedule=["a", "b", "a", "c"])
    la.access("a")
    assert la.next_use("a") == 2
    la.access("b")
    la.access("a")
    assert la.next_use("a") == 2
    assert la.next_use("b") == 3
    assert la.relearned == 0


def test_lookahead_learns_first_cycle_then_follows() -> None:
    la = LookaheadPolicy()
    assert la.schedule is None
    for key in ["x", "y", "z"]:
        la.access(key)
        assert list(la.upcoming()) == []
    la.access("x")
    assert la.schedule == ["x", "y", "z"]
    assert list(la.upcoming()) == ["y", "z"]
    la.access("x")  # a repeat of the latest access counts once
    la.access("y")
    assert la.next_use("x") == 2
    assert la.relearned == 0


def test_lookahead_relearns_on_divergence() -> None:
    la = LookaheadPolicy(schedule=["a", "b", "c"])
    la.access("a")
    la.access("c")  # expected b
    assert la.relearned == 1
    assert la.schedule is None
    for key in ["d", "c"]:
        la.access(key)
    assert la.schedule == ["c", "d"]


def test_lookahead_while_learning_acts_like_lru() -> None:
    la = LookaheadPolicy()
    for key in ["a", "b", "c"]:
        la.access(key)
    assert la.victim(["a", "b", "c"], None) == "a"


def test_set_schedule_validates() -> None:
    la = LookaheadPolicy()
    with pytest.raises(ConfigError, match="non-empty"):
        la.set_schedule([])
    with pytest.raises(ConfigError, match="twice in a row"):
        la.set_schedule(["a", "a"])
    with pytest.raises(ConfigError, match="non-empty sequence of str"):
        la.set_schedule(["a", 1])  # type: ignore[list-item]
    la.set_schedule(["p", "q"])
    la.access("q")  # the first access may be any key of the schedule
    assert list(la.upcoming()) == ["p"]
