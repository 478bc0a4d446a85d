"""Streamed parameters stepping in backward: the gradients held in memory for their slices,
and the reads of the next slices' state started ahead.

With ``offload_parameters`` a slice steps in its gradient hook (``overlap="auto"`` or
``"backward"``), with each gradient taken from memory: the stream returns it as it keeps it
(or, unchecked, instead of keeping it), and it is held here until every slice it feeds has
stepped. Meanwhile the state of the slices that step next in backward (layout order: the
layout lists the last parameters first) is read ahead within half the room the host budget
has, the first ones from ``step()`` on when forward reads no parameter (forward hides them):
the other half is left to
the parameters' reads and the gradients' writes, which would else drop reads started ahead to
make room and read them again.

Private to :mod:`tierswap.optim.step`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierswap.optim.plan import Layout, Slice
from tierswap.pipeline import Job, Pipeline

__all__ = ["HeldGradients"]


class HeldGradients:
    """The gradients a step in backward holds (:attr:`grads`, by slot index: the
    :class:`~tierswap.optim.plan.StepPlan`'s ``held``) and where its read-ahead stands. Used
    from the thread backward runs on, and from ``step()``."""

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self._ahead_from = 0  # slices from this index on may still be read ahead

    def clear(self) -> None:
        """A step ended, or its gradients were dropped: hold nothing, read ahead anew."""
        self.grads.clear()
        self._ahead_from = 0

    def let_go(self, layout: Layout, stepped: list[Slice], waits: Callable[[Slice], bool]) -> None:
        """Drop the gradients of the slots of ``stepped`` of which no slice ``waits`` for its
        step in backward with them (a slice that steps after backward from the kept gradient
        does not: holding it there would keep a whole gradient beyond the budgets)."""
        for index in {seg.slot.index for piece in stepped for seg in piece.segments}:
            if index in self.grads and not any(map(waits, layout.slices_of[index])):
                del self.grads[index]

    def read_ahead(
        self, layout: Layout, pipeline: Pipeline, job_for: Callable[[Slice], Job | None]
    ) -> None:
        """Start reading the state of the slices that step next in backward, within half the
        host budget's free room, from where the last call stopped: each slice is handed over
        once a backward pass (a read dropped for room starts again when its slice steps).
        ``job_for(piece)``: its job, its gradients in memory; ``None`` for a slice not to read
        (handed over already, or one that does not step in backward)."""
        room = (pipeline.budget - pipeline.held) // 2
        jobs: list[Job] = []
        index = self._ahead_from
        while index < len(layout.slices):
            job = job_for(layout.slices[index])
            if job is not None:
                if job.nbytes > room:
                    break
                jobs.append(job)
                room -= job.nbytes
            index += 1
        self._ahead_from = index
        if jobs:
            pipeline.prefetch(jobs)
