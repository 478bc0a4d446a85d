"""The order in which a model's modules use their streamed parameters.

A training iteration uses the modules in the same order every time (forward, then backward,
with a checkpoint's recomputations where they fall). :class:`UseOrder` records that order over
the first iteration (up to the first ``step()``) and then follows it: which modules come next
(their parameters are read ahead) and how soon each parameter is used again (Belady: the
parameters kept between uses are those used again soonest). Private to
:mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["UseOrder"]


class UseOrder:
    """The recorded order of module uses (module positions) and the place of the current use
    in it. ``recording`` until the first step ends it (:meth:`step_begins`). Not thread-safe:
    its owner (the parameter stream) calls it from one thread at a time."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Forget the order (the modules were numbered anew) and record it again."""
        self._order: list[int] = []  # module positions in the order of their uses
        self._uses: dict[int, list[int]] = {}  # slot index -> its places in ``_order``
        self._cursor = 0  # the place after the current use
        self.recording = True

    def used(self, position: int, ahead: int) -> list[int]:
        """Module ``position`` is used now: record it (while recording: returns ``[]``), or find
        it in the order, from the current place on (else from the start), and return the
        ``ahead`` modules that follow it (``[]`` if the order lacks it)."""
        if self.recording:
            self._order.append(position)
            return []
        order = self._order
        try:
            found = order.index(position, self._cursor)
        except ValueError:
            found = order.index(position) if position in order else -1
        if found < 0:
            return []
        self._cursor = found + 1
        return order[self._cursor : self._cursor + ahead]

    def step_begins(self, owned: Sequence[Iterable[int]]) -> None:
        """A step begins: the next iteration's uses start the order again. The first step ends
        the recording: each slot's places in the order come from ``owned`` (module position ->
        the slot indices it uses)."""
        if self.recording:
            self.recording = False
            for place, module in enumerate(self._order):
                for index in owned[module]:
                    self._uses.setdefault(index, []).append(place)
        self._cursor = 0

    def next_use(self, index: int) -> int:
        """Uses of modules until the parameter of slot ``index`` is used again (the order is
        cyclic: the next iteration repeats it); twice the order's length if it is not in it."""
        uses, cycle = self._uses.get(index, []), len(self._order)
        later = [u for u in uses if u >= self._cursor]
        return (later[0] if later else uses[0] + cycle) - self._cursor if uses else 2 * cycle

    def keep_soonest(self, idle: Iterable[int], room: int, size: Callable[[int], int]) -> set[int]:
        """Belady within ``room`` bytes: the slots of ``idle`` (``size`` bytes each) taken in the
        order of their next use, each while it fits in what is left (while recording, those
        that fit)."""
        kept: set[int] = set()
        for index in sorted(idle, key=self.next_use):
            if size(index) <= room:
                kept.add(index)
                room -= size(index)
        return kept
