"""Reference simulations of one cache tier on a cyclic schedule: Belady's optimum and LRU.

Pure Python, so tests and ``bench/cache_policy.py`` can compare what the cache really read
against an ideal (or an LRU) cache on the same schedule, with demand paging. With equal sizes
Belady's rule (evict the item used furthest in the future) reads the fewest items any cache of
that capacity can; with mixed sizes it is the classic heuristic."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal

from tierswap.errors import ConfigError

__all__ = ["CycleReads", "simulate"]


@dataclasses.dataclass(frozen=True)
class CycleReads:
    """What one cycle of the schedule read from the lower tier."""

    reads: int
    bytes: int


def simulate(
    schedule: Sequence[str],
    sizes: Mapping[str, int],
    budget: int,
    *,
    cycles: int,
    policy: Literal["belady", "lru"] = "belady",
    resident: Sequence[str] = (),
) -> list[CycleReads]:
    """Replay ``cycles`` repetitions of ``schedule`` on a tier of ``budget`` bytes.

    The tier starts empty, or holding ``resident`` (least recently used first). Items larger
    than ``budget`` are never cached (read at every use). Returns one :class:`CycleReads` per
    cycle.
    """
    if cycles < 0 or budget < 0:
        raise ConfigError(f"cycles={cycles} and budget={budget} must be >= 0")
    missing = sorted(set(schedule) - set(sizes))
    if missing:
        raise ConfigError(f"sizes lacks keys {missing[:5]}; give a size for every scheduled key")
    if policy not in ("belady", "lru"):
        raise ConfigError(f"policy={policy!r} must be 'belady' or 'lru'")
    gaps = _next_use_gaps(schedule)
    first_use = {k: i for i, k in reversed(list(enumerate(schedule)))}
    held: OrderedDict[str, float] = OrderedDict()  # key -> next use time (belady) or touch
    for n, key in enumerate(resident):
        held[key] = first_use.get(key, float("inf")) if policy == "belady" else n - len(resident)
    out = []
    for cycle in range(cycles):
        reads = nbytes = 0
        for i, key in enumerate(schedule):
            now = cycle * len(schedule) + i
            stamp = now + gaps[i] if policy == "belady" else now
            missed = _step(
                held, key, sizes=sizes, budget=budget, stamp=stamp, belady=policy == "belady"
            )
            reads += missed
            nbytes += sizes[key] if missed else 0
        out.append(CycleReads(reads, nbytes))
    return out


def _next_use_gaps(schedule: Sequence[str]) -> list[int]:
    """For each position, how many steps until the same key comes back (cyclically)."""
    length = len(schedule)
    gaps = [0] * length
    last: dict[str, int] = {}
    for i in range(2 * length - 1, -1, -1):
        key = schedule[i % length]
        if i < length:
            gaps[i] = last[key] - i
        last[key] = i
    return gaps


def _step(
    resident: OrderedDict[str, float],
    key: str,
    *,
    sizes: Mapping[str, int],
    budget: int,
    stamp: float,
    belady: bool,
) -> bool:
    """Use ``key``; return True on a miss. ``stamp`` is the key's next use (Belady, which evicts
    the largest) or the time of this use (LRU, which evicts the oldest in order)."""
    hit = key in resident
    fits = sizes[key] <= budget
    if not hit and fits:
        used = sum(sizes[k] for k in resident)
        while used + sizes[key] > budget:
            victim = max(resident, key=resident.__getitem__) if belady else next(iter(resident))
            used -= sizes[victim]
            del resident[victim]
    if hit or fits:
        resident[key] = stamp
        if not belady:
            resident.move_to_end(key)
    return not hit
