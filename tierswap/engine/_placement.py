"""Which items of a cyclic schedule stay resident, and in which tier: the policy decides.

A training step touches its slices in the same order every step. The policy is replayed on two
cycles of that schedule against a tier's capacity (demand paging: each use of an item not held
is a miss, room is made by evicting the policy's victims); the items that hit in the second
cycle stay resident, the rest streams. The device tier is filled first, then host memory from
what the device does not hold. On a cycle larger than the tier LRU keeps nothing; lookahead
(Belady) keeps all but about one item's worth, the optimum.

Private to :mod:`tierswap.engine`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierswap.engine.belady import replay
from tierswap.engine.policies import EvictionPolicy, ScheduledPolicy, policy_per_tier

__all__ = ["place"]


def place(
    policy: str | EvictionPolicy,
    schedule: Sequence[str],
    sizes: Mapping[str, int],
    capacities: Mapping[str, int],
) -> dict[str, str]:
    """``{key: tier}`` for the items that stay resident, tiers taken in ``capacities``' order
    (device first), each replaying its own copy of ``policy`` (:func:`policy_per_tier`) on the
    items left."""
    placed: dict[str, str] = {}
    for tier, capacity in capacities.items():
        left = [key for key in schedule if key not in placed]
        for key in kept(policy_per_tier(policy), left, sizes, capacity):
            placed[key] = tier
    return placed


def kept(
    policy: EvictionPolicy, schedule: Sequence[str], sizes: Mapping[str, int], capacity: int
) -> list[str]:
    """The items of ``schedule`` that ``policy`` keeps across a whole cycle in ``capacity``
    bytes (those that hit in the second of two replayed cycles), in schedule order."""
    if capacity <= 0 or not schedule:
        return []
    if sum(sizes[key] for key in schedule) <= capacity:
        return list(schedule)  # everything fits: nothing is ever evicted
    if isinstance(policy, ScheduledPolicy) and policy.schedule is None:
        policy.set_schedule(list(schedule))  # a lookahead policy need not learn what is known
    uses = replay(
        schedule, sizes, capacity, 2,
        use=lambda key, _: policy.access(key), victim=lambda held: policy.victim(held, None),
    )  # fmt: skip
    return [key for cycle, key, hit in uses if cycle and hit]
