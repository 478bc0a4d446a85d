"""The resident book of one memory tier: what a front end keeps there between uses, and the
bytes its ledger holds for each.

Private to :mod:`tierswap.engine`.
"""

from __future__ import annotations

from collections.abc import Hashable, ItemsView, Iterator, Mapping, ValuesView
from typing import TypeVar

from tierswap.engine._ledger import Ledger

__all__ = ["ResidentSet"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ResidentSet(Mapping[K, V]):
    """Items kept in one tier (``ledger``'s), each with the bytes reserved for it before it joins
    (:meth:`keep`). An item leaves with its bytes released (:meth:`drop`) or still reserved
    (:meth:`leave`: the caller moves them on, e.g. to a write-back that frees them once the store
    has the bytes). ``nbytes`` sums the items, so a front end can tell what of ``ledger.used`` is
    resident and what is in flight. Called under the condition that guards ``ledger``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._values: dict[K, V] = {}
        self._sizes: dict[K, int] = {}
        self.nbytes = 0

    def keep(self, key: K, value: V, nbytes: int) -> None:
        """``key`` joins with ``value``; its ``nbytes`` were reserved in the ledger before."""
        if key in self._values:
            raise AssertionError(f"{self.ledger.name} tier: {key!r} is resident already")
        self._values[key], self._sizes[key] = value, nbytes
        self.nbytes += nbytes

    def leave(self, key: K) -> tuple[V, int]:
        """``key`` leaves; its value and bytes, which stay reserved for the caller to move on."""
        nbytes = self._sizes.pop(key)
        self.nbytes -= nbytes
        return self._values.pop(key), nbytes

    def drop(self, key: K) -> V:
        """``key`` leaves and its bytes return to the ledger."""
        value, nbytes = self.leave(key)
        self.ledger.release(nbytes)
        return value

    def clear(self) -> list[V]:
        """Drop every item (bytes released); their values."""
        return [self.drop(key) for key in list(self._values)]

    def __getitem__(self, key: K) -> V:
        return self._values[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    # the dict's own lookups: the mixin's go through __getitem__ and are ten times slower on
    # a miss or a scan, which the cache's victim choice and the pipeline's tier lookups do
    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def values(self) -> ValuesView[V]:
        return self._values.values()

    def items(self) -> ItemsView[K, V]:
        return self._values.items()
