"""The reads of the next modules' parameters, started ahead of their use.

Once the order of uses is recorded, each use of a module starts reading the values of the
parameters the next modules use (:meth:`ReadsAhead.start`): one pipeline job a segment that
no resident slice holds, as far as the host budget has room. The use that needs them reads
through those jobs (:func:`~tierswap.optim.stream._swap.read_into` consumes them by name,
from :attr:`ReadsAhead.names`). Under a step that runs into the forward
(``overlap="forward"``), a parameter whose slices have still to step would be read stale:
its read starts after the slice that steps it last (:meth:`ReadsAhead.stepped`, which the
step calls after each slice). The stream drops the reads (:meth:`ReadsAhead.drop`) when what
they read changes: a step begins, values written outside the optimizer are kept, a state
dict is loaded.

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterable

from tierswap.optim.persist import OptimizerParts
from tierswap.optim.stream._into_forward import StepIntoForward
from tierswap.optim.stream._swap import read_job, segments

__all__ = ["ReadsAhead"]


class ReadsAhead:
    """The reads started ahead for the parameters of an optimizer's ``parts`` (slot
    indices of its layout), under the ``step`` that may run into the forward."""

    def __init__(self, parts: OptimizerParts, step: StepIntoForward) -> None:
        self._parts = parts
        self._step = step
        #: The names of the jobs read ahead that no use has consumed yet.
        self.names: set[Hashable] = set()
        #: Slots whose read waits for the step into the forward to update their parameter.
        self._after_step: set[int] = set()
        step.after_each_slice(weakref.WeakMethod(self.stepped))

    def start(self, indices: Iterable[int]) -> None:
        """Read ahead the values of the parameters of slots ``indices`` (the next modules'):
        now, or once the step into the forward has updated them (those waiting from an
        earlier call are the modules before these: their own uses read them)."""
        slots, indices = self._parts.layout.slots, list(indices)  # (read twice below)
        self._after_step = {i for i in indices if self._step.pending(slots[i].param)}
        self._read([i for i in indices if i not in self._after_step])

    def stepped(self) -> None:
        """On the thread of a step into the forward, after each of its slices: read ahead the
        parameters waiting for it that it has updated now."""
        slots = self._parts.layout.slots
        ready = [i for i in self._after_step if not self._step.pending(slots[i].param)]
        if ready:
            self._after_step.difference_update(ready)
            with contextlib.suppress(Exception):  # a hint: their use reads them (raising then)
                self._read(ready)

    def drop(self) -> None:
        """Drop the reads started ahead that no use consumed, and those waiting to start."""
        self._after_step.clear()
        if self.names:
            self._parts.backend.pipeline.release(self.names)
            self.names.clear()

    def _read(self, indices: list[int]) -> None:
        """Start the reads of the parameters of slots ``indices`` (their segments that the
        resident slices do not hold), as far as the host budget has room."""
        pipeline, layout = self._parts.backend.pipeline, self._parts.layout
        jobs = [
            read_job(layout.slots[i], seg)
            for i in indices
            for piece, seg in segments(layout, layout.slots[i])
            if pipeline.resident_tier(piece) is None
        ]
        if jobs:
            pipeline.prefetch(jobs)
            self.names.update(job.name for job in jobs)
