"""NVMe reads on a training-like cyclic schedule: LRU vs lookahead vs Belady's optimum.

Reads are attributed to the access they serve (the next use of that key after the read), so a
prefetch issued during cycle c for an item used in cycle c+1 counts for cycle c+1, as in the
demand-paging simulation it is compared with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierswap import LookaheadPolicy, TierCache
from tierswap.engine.belady import simulate

from .conftest import LoggingStore

PAGE = 4096
CYCLES = 6

SCHEDULES = {
    "10-items-4-slots": ([f"p{i}" for i in range(10)], 4),
    "12-items-5-slots": ([f"p{i}" for i in range(12)], 5),
    "repeats-7-items-3-slots": (["h", "e", "p0", "p1", "p2", "e", "p3", "p4", "p2"], 3),
}


def _fill(store: LoggingStore, keys: list[str]) -> None:
    for i, key in enumerate(sorted(set(keys))):
        store.put(key, torch.full((PAGE // 4,), float(i)))
    store.log.clear()


def _run(store: LoggingStore, policy: Any, schedule: list[str], slots: int, *, dirty: bool):
    """Run CYCLES cycles; return (reads per cycle, keys resident after the first cycle)."""
    cache = TierCache(store, device_budget=0, host_budget=slots * PAGE, policy=policy)
    after_first: list[str] = []
    for cycle in range(CYCLES):
        for key in schedule:
            if dirty:
                with cache.pinned(key, tier="host", dirty=True) as t:
                    t.add_(1)
            else:
                cache.get(key, tier="host")
            store.log.append(("use", key))
            assert cache.stats().host.used <= slots * PAGE
        if cycle == 0:
            after_first = [k for k in dict.fromkeys(schedule) if cache.where(k) == "host"]
    cache.close()
    return _attribute(store.log, len(schedule)), after_first


def _attribute(log: list[tuple[str, str]], cycle_len: int) -> list[int]:
    """Reads per cycle, each read charged to the cycle of the use it served."""
    per_cycle = [0] * CYCLES
    pending: dict[str, int] = {}
    uses = 0
    for kind, key in log:
        if kind == "read":
            pending[key] = pending.get(key, 0) + 1
        elif kind == "use":
            per_cycle[uses // cycle_len] += pending.pop(key, 0)
            uses += 1
    return per_cycle


@pytest.mark.parametrize("dirty", [False, True], ids=["read-only", "read-modify-write"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lookahead_reads_equal_belady(logged: LoggingStore, name: str, dirty: bool) -> None:
    schedule, slots = SCHEDULES[name]
    _fill(logged, schedule)
    sizes = dict.fromkeys(schedule, PAGE)
    belady = [r.reads for r in simulate(schedule, sizes, slots * PAGE, cycles=CYCLES)]
    reads, _ = _run(logged, LookaheadPolicy(schedule=schedule), schedule, slots, dirty=dirty)
    assert reads == belady
    lru = [r.reads for r in simulate(schedule, sizes, slots * PAGE, cycles=CYCLES, policy="lru")]
    assert sum(belady) < sum(lru)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_learned_schedule_reads_equal_belady_after_one_cycle(
    logged: LoggingStore, name: str
) -> None:
    schedule, slots = SCHEDULES[name]
    _fill(logged, schedule)
    sizes = dict.fromkeys(schedule, PAGE)
    policy = LookaheadPolicy()
    reads, resident = _run(logged, policy, schedule, slots, dirty=True)
    assert policy.schedule == schedule
    assert policy.relearned == 0
    # The first cycle is recorded (LRU meanwhile); from then on the cache is Belady's.
    lru_first = simulate(schedule, sizes, slots * PAGE, cycles=1, policy="lru")
    assert reads[0] == lru_first[0].reads
    belady = simulate(schedule, sizes, slots * PAGE, cycles=CYCLES - 1, resident=resident)
    assert reads[1:] == [r.reads for r in belady]


@pytest.mark.parametrize("dirty", [False, True], ids=["read-only", "read-modify-write"])
def test_lru_rereads_the_whole_working_set_every_cycle(logged: LoggingStore, dirty: bool) -> None:
    schedule, slots = SCHEDULES["10-items-4-slots"]
    _fill(logged, schedule)
    reads, _ = _run(logged, "lru", schedule, slots, dirty=dirty)
    assert reads == [len(schedule)] * CYCLES


def test_values_survive_many_cycles_of_write_back(logged: LoggingStore) -> None:
    schedule, slots = SCHEDULES["repeats-7-items-3-slots"]
    _fill(logged, schedule)
    _run(logged, LookaheadPolicy(schedule=schedule), schedule, slots, dirty=True)
    for i, key in enumerate(sorted(set(schedule))):
        expected = float(i) + CYCLES * schedule.count(key)
        torch.testing.assert_close(logged.get(key), torch.full((PAGE // 4,), expected))
