from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.engine.belady import CycleReads, simulate
from tierswap.errors import ConfigError


def _keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def test_three_items_two_slots_alternates() -> None:
    keys = _keys(3)
    reads = simulate(keys, dict.fromkeys(keys, 1), 2, cycles=6)
    assert [r.reads for r in reads] == [3, 1, 2, 1, 2, 1]
    assert reads[0] == CycleReads(3, 3)


@pytest.mark.parametrize(("n", "slots"), [(4, 2), (10, 4), (7, 6)])
def test_lru_rereads_everything_on_a_cycle_larger_than_the_tier(n: int, slots: int) -> None:
    keys = _keys(n)
    reads = simulate(keys, dict.fromkeys(keys, 8), 8 * slots, cycles=4, policy="lru")
    assert [r.reads for r in reads] == [n] * 4
    assert [r.bytes for r in reads] == [8 * n] * 4


def test_everything_fits_reads_once() -> None:
    keys = _keys(5)
    for policy in ("belady", "lru"):
        reads = simulate(keys, dict.fromkeys(keys, 1), 5, cycles=3, policy=policy)  # type: ignore[arg-type]
        assert [r.reads for r in reads] == [5, 0, 0]


def test_items_larger_than_the_budget_are_read_every_time() -> None:
    sizes = {"big": 10, "a": 1}
    reads = simulate(["big", "a"], sizes, 5, cycles=3)
    assert [r.reads for r in reads] == [2, 1, 1]


def test_starting_resident_set() -> None:
    keys = _keys(3)
    reads = simulate(keys, dict.fromkeys(keys, 1), 2, cycles=1, resident=["k0", "k1"])
    assert reads == [CycleReads(1, 1)]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="sizes lacks"):
        simulate(["a"], {}, 1, cycles=1)
    with pytest.raises(ConfigError, match="policy="):
        simulate(["a"], {"a": 1}, 1, cycles=1, policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cycles="):
        simulate(["a"], {"a": 1}, 1, cycles=-1)


def _optimal_misses(trace: tuple[str, ...], slots: int) -> int:
    """Fewest misses any demand-paging cache of ``slots`` equal items can have (exhaustive)."""

    @functools.cache
    def best(i: int, cache: frozenset[str]) -> int:
        if i == len(trace):
            return 0
        key = trace[i]
        if key in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, cache | {key})
        return 1 + min(best(i + 1, (cache - {v}) | {key}) for v in cache)

    return best(0, frozenset())


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.lists(st.sampled_from("abcdef"), min_size=2, max_size=8).filter(
        lambda s: all(a != b for a, b in itertools.pairwise(s))
    ),
    slots=st.integers(1, 4),
)
def test_belady_equals_exhaustive_optimum(schedule: list[str], slots: int) -> None:
    cycles = 3
    reads = simulate(schedule, dict.fromkeys(schedule, 1), slots, cycles=cycles)
    assert sum(r.reads for r in reads) == _optimal_misses(tuple(schedule * cycles), slots)
