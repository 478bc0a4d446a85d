"""Eviction policies: which resident item leaves a tier first, and what to read ahead.

A policy sees the stream of accesses and answers :class:`TierCache` two questions:
``victim(candidates, incoming)`` (what leaves to make room: for a demand miss, ``incoming=None``,
some item must go; for a prefetch of ``incoming`` it may answer ``None``, "evicting now would do
harm") and ``upcoming()`` (the keys it expects next, soonest first, prefetched in order).

A policy is not thread-safe on its own: the cache calls it under its lock. One instance serves
one cache; the optimizer's placement replays a copy per tier (:func:`policy_per_tier`). A
policy that can be handed the schedule ahead declares it by :class:`ScheduledPolicy`."""

from __future__ import annotations

import bisect
import copy
import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from tierswap.errors import ConfigError

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "LookaheadPolicy",
    "ScheduledPolicy",
    "make_policy",
    "policy_per_tier",
]

NEVER = float("inf")


@runtime_checkable
class EvictionPolicy(Protocol):
    """What :class:`~tierswap.TierCache` needs from a policy (five methods)."""

    def access(self, key: str) -> None:
        """The caller used ``key`` (``get``, ``put``, ``pinned``); repeats in a row count once."""

    def admit(self, key: str) -> None:
        """``key`` is about to be read in ahead of use (a prefetch)."""

    def forget(self, key: str) -> None:
        """``key`` was deleted; drop what is known about it."""

    def victim(self, candidates: Collection[str], incoming: str | None) -> str | None:
        """The key among ``candidates`` (resident keys of one tier) to evict. ``incoming=None``
        is a demand miss and must name one; else ``incoming`` is a key being prefetched (or
        moved down) and ``None`` means "wait: every choice evicts something needed before it"."""

    def upcoming(self) -> Iterable[str]:
        """Keys expected next after the latest access, soonest first (may be empty or lazy)."""


@runtime_checkable
class ScheduledPolicy(EvictionPolicy, Protocol):
    """A policy that can be told the schedule ahead instead of learning it (lookahead)."""

    @property
    def schedule(self) -> list[str] | None:
        """The schedule it holds, or ``None`` while it has none."""

    def set_schedule(self, schedule: Sequence[str]) -> None:
        """Replace it: the keys in the order they will be used, one cycle."""


class LRUPolicy:
    """Least recently used: evict the item touched longest ago; never prefetches on its own.

    On a cyclic access pattern larger than the cache, LRU evicts each item just before it is
    needed again and re-reads the whole working set every cycle.
    """

    name = "lru"

    def __init__(self) -> None:
        self._last_touch: OrderedDict[str, int] = OrderedDict()
        self._clock = itertools.count()

    def access(self, key: str) -> None:
        self._touch(key)

    def admit(self, key: str) -> None:
        self._touch(key)

    def forget(self, key: str) -> None:
        self._last_touch.pop(key, None)

    def victim(self, candidates: Collection[str], incoming: str | None) -> str | None:
        """The least recently touched candidate; for a prefetch only one older than it."""
        if not candidates:
            return None
        oldest = max(candidates, key=self.rank)
        if incoming is not None and self.rank(oldest) <= self.rank(incoming):
            return None
        return oldest

    def rank(self, key: str) -> float:
        """Eviction eagerness: older touches rank higher; never-touched keys highest."""
        touched = self._last_touch.get(key)
        return NEVER if touched is None else float(-touched)

    def upcoming(self) -> Iterable[str]:
        return ()

    def _touch(self, key: str) -> None:
        self._last_touch[key] = next(self._clock)
        self._last_touch.move_to_end(key)

    def __repr__(self) -> str:
        return "LRUPolicy()"


class LookaheadPolicy:
    """Belady eviction and read-ahead on a cyclic schedule of keys.

    A demand miss evicts the resident item whose next use (:meth:`next_use`) is furthest away.
    ``upcoming()`` walks the schedule from the current position; a prefetch of ``u`` evicts the
    item Belady would evict when ``u`` is used, once that item is not needed before ``u``. On a
    repeating schedule the cache then reads exactly as many items as Belady's optimum, earlier.

    Parameters
    ----------
    schedule:
        The keys in the order one cycle (e.g. one training step) touches them; a key may occur
        more than once, not twice in a row. ``None`` learns it: accesses are recorded until the
        first key of the recording comes again, and that cycle is taken to repeat. An access that
        departs from the schedule makes the policy learn again from there (meanwhile it behaves as
        LRU and reads nothing ahead); :meth:`set_schedule` hands in a new one at any time."""

    name = "lookahead"

    def __init__(self, schedule: Sequence[str] | None = None) -> None:
        self._lru = LRUPolicy()
        self._schedule: list[str] = []
        self._positions: dict[str, list[int]] = {}
        self._pos = -1  # index in the schedule of the latest access; -1 before the first
        self._trace: list[str] = []
        self._last: str | None = None
        self.relearned = 0  # how many times an access departed from the schedule
        if schedule is not None:
            self.set_schedule(schedule)

    @property
    def schedule(self) -> list[str] | None:
        """The schedule in use, or ``None`` while learning."""
        return list(self._schedule) if self._schedule else None

    def set_schedule(self, schedule: Sequence[str]) -> None:
        """Use ``schedule`` from now on; the next access may be any of its keys."""
        keys = list(schedule)
        if not keys or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"schedule={schedule!r} must be a non-empty sequence of str keys")
        if any(a == b for a, b in itertools.pairwise(keys)):
            raise ConfigError("schedule repeats a key twice in a row; list each access once")
        self._install(keys)
        self._pos = -1

    def access(self, key: str) -> None:
        if key == self._last:
            return
        self._last = key
        self._lru.access(key)
        if self._schedule:
            self._follow(key)
        else:
            self._learn(key)

    def admit(self, key: str) -> None:
        """While learning, behave as LRU; with a schedule, the schedule decides."""
        if not self._schedule:
            self._lru.admit(key)

    def forget(self, key: str) -> None:
        self._lru.forget(key)

    def victim(self, candidates: Collection[str], incoming: str | None) -> str | None:
        """Belady: the candidate used furthest in the future (seen from ``incoming``'s use).

        For a prefetch of ``incoming`` the choice is the item Belady would evict at the moment
        ``incoming`` is used, and only if that item is not needed before then; otherwise
        ``None`` (wait). So prefetching changes when items are read, never how many.
        """
        if not candidates:
            return None
        if not self._schedule:
            return self._lru.victim(candidates, incoming)
        if incoming is None:
            return max(candidates, key=self.next_use)
        ahead = self.next_use(incoming)
        if ahead == NEVER:
            return None
        start = (self._pos + int(ahead) - 1) % len(self._schedule)
        chosen = max(candidates, key=lambda k: self._gap(k, start))
        return chosen if self.next_use(chosen) > ahead else None

    def next_use(self, key: str) -> float:
        """Accesses from the current position until ``key`` is used again (``inf``: never)."""
        return self._gap(key, self._pos)

    def _gap(self, key: str, start: int) -> float:
        """Steps from schedule position ``start`` to the next use of ``key`` after it."""
        positions = self._positions.get(key)
        if not positions:
            return NEVER
        i = bisect.bisect_right(positions, start)
        nxt = positions[i] if i < len(positions) else positions[0] + len(self._schedule)
        return nxt - start

    def upcoming(self) -> Iterator[str]:
        if not self._schedule:
            return iter(())
        schedule, start = self._schedule, self._pos + 1  # a snapshot: relearning swaps the list
        length = len(schedule)
        return (schedule[(start + i) % length] for i in range(length - 1))

    def _follow(self, key: str) -> None:
        length = len(self._schedule)
        if self._pos == -1 and key in self._positions:  # first access: any key of the schedule
            self._pos = self._positions[key][0]
            return
        if self._pos != -1 and key == self._schedule[(self._pos + 1) % length]:
            self._pos = (self._pos + 1) % length
            return
        self.relearned += 1
        self._install([])
        self._trace = [key]

    def _learn(self, key: str) -> None:
        if self._trace and key == self._trace[0]:
            self._install(self._trace)
            self._pos = 0
            self._trace = []
            return
        self._trace.append(key)

    def _install(self, keys: list[str]) -> None:
        self._schedule = keys
        self._positions = {}
        for i, k in enumerate(keys):
            self._positions.setdefault(k, []).append(i)

    def __repr__(self) -> str:
        size = len(self._schedule) if self._schedule else "learning"
        return f"LookaheadPolicy(schedule=<{size}>)"


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a name (``"lru"``, ``"lookahead"``) or an instance."""
    if isinstance(policy, str):
        factories: dict[str, Callable[[], EvictionPolicy]] = {
            "lru": LRUPolicy,
            "lookahead": LookaheadPolicy,
        }
        if policy not in factories:
            raise ConfigError(
                f"policy={policy!r} is unknown; use 'lru', 'lookahead' or an instance"
            )
        return factories[policy]()
    if not isinstance(policy, EvictionPolicy):
        raise ConfigError(
            f"policy={policy!r} lacks access/admit/forget/victim/upcoming; see EvictionPolicy"
        )
    return policy


def policy_per_tier(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy of its own for one tier: a new one for a name, a copy of an instance.

    A policy learns from what it sees (recency, a schedule), so one instance shared by two
    tiers would let one tier's replay steer the other's: each tier takes its own, and the
    caller's instance stays as it was.
    """
    chosen = make_policy(policy)
    if isinstance(policy, str):
        return chosen
    try:
        return copy.deepcopy(chosen)
    except Exception as exc:  # a lock, a file, ... that cannot be copied
        raise ConfigError(
            f"policy={policy!r} cannot be copied for each tier ({type(exc).__name__}: {exc}); "
            "pass a policy that copy.deepcopy can copy, or a name ('lru', 'lookahead')"
        ) from exc
