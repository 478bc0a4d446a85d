"""Replays of one cache tier on a cyclic schedule, with demand paging: :func:`replay` (any
victim rule; :func:`~tierswap.engine.place` replays a policy on it) and :func:`simulate`,
Belady's optimum and LRU as references.

Pure Python, so tests and ``bench/cache_policy.py`` can compare what the cache really read
against an ideal (or an LRU) cache on the same schedule. With equal sizes Belady's rule (evict
the item used furthest in the future) reads the fewest items any cache of that capacity can;
with mixed sizes it is the classic heuristic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Literal

from tierswap.errors import ConfigError

__all__ = ["CycleReads", "replay", "simulate"]


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
    belady, gaps = policy == "belady", _next_use_gaps(schedule)
    first_use = {k: i for i, k in reversed(list(enumerate(schedule)))}
    # each key's next use (Belady evicts the furthest) or latest use (LRU evicts the oldest)
    stamps = {
        k: first_use.get(k, float("inf")) if belady else n - len(resident)
        for n, k in enumerate(resident)
    }

    def use(key: str, now: int) -> None:
        stamps[key] = now + gaps[now % len(schedule)] if belady else now

    def victim(held: Collection[str]) -> str:
        return (max if belady else min)(held, key=stamps.__getitem__)

    start = {key: sizes[key] for key in resident}
    out = [CycleReads(0, 0) for _ in range(cycles)]
    for cycle, key, hit in replay(
        schedule, sizes, budget, cycles, use=use, victim=victim, held=start
    ):
        if not hit:
            out[cycle] = CycleReads(out[cycle].reads + 1, out[cycle].bytes + sizes[key])
    return out


def replay(
    schedule: Sequence[str],
    sizes: Mapping[str, int],
    capacity: int,
    cycles: int,
    *,
    use: Callable[[str, int], None],
    victim: Callable[[Collection[str]], str | None],
    held: Mapping[str, int] | None = None,
) -> Iterator[tuple[int, str, bool]]:
    """Demand paging of ``cycles`` repetitions of ``schedule`` on ``capacity`` bytes holding
    ``held`` (key -> size) at first: ``(cycle, key, hit)`` for each use. ``use(key, now)`` hears
    of each use first; on a miss, ``victim(held keys)`` names what leaves to make room
    (``None``: nothing may, and the key is not kept). Items larger than ``capacity`` are never
    kept."""
    kept = dict(held or {})
    used = sum(kept.values())
    for cycle in range(cycles):
        for i, key in enumerate(schedule):
            use(key, cycle * len(schedule) + i)
            hit = key in kept
            if not hit and sizes[key] <= capacity:
                while used + sizes[key] > capacity:
                    chosen = victim(list(kept))
                    if chosen is None or chosen not in kept:
                        break
                    used -= kept.pop(chosen)
                if used + sizes[key] <= capacity:
                    kept[key] = sizes[key]
                    used += sizes[key]
            yield cycle, key, hit


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
