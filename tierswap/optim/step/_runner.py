"""Slices through the optimizer's pipeline: each slice's job, a step's plan, and the work the
pipeline calls for each slice.

The :class:`~tierswap.optim.step._stepper.Stepper` decides when slices step (in backward, in
``step()``, into the next forward); its :class:`SliceRunner` runs them: it makes their jobs
(:func:`~tierswap.optim.step._slice_job.slice_job`), starts their reads ahead, holds the 8-bit
scales where the layout keeps them in host memory, and steps each slice's tensors with
:func:`~tierswap.optim.step._slice_work.step_slice` as the pipeline hands them over.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from concurrent.futures import Future
from typing import Any, cast

import torch

from tierswap.optim.persist import OptimizerParts
from tierswap.optim.plan import Slice, StepPlan
from tierswap.optim.step._deferred import DeferredSteps
from tierswap.optim.step._memory import trim_heap
from tierswap.optim.step._slice_job import (
    SCALES_JOB,
    scales_job,
    scales_views,
    slice_job,
    unbuffered_masters,
)
from tierswap.optim.step._slice_work import step_slice
from tierswap.optim.step._speculation import Speculation, stamps_of
from tierswap.pipeline import Job, Region

__all__ = ["SliceRunner"]


class SliceRunner:
    """Runs slices of ``parts`` through its pipeline: ``deferred`` hears which parameters
    each slice updated (a forward waiting for them goes on), ``speculation`` records the
    slices a speculative run stepped. Whether a step's masters may lag their kept parameters
    (:attr:`~tierswap.optim.plan.StepPlan.unwritten`) is the caller's to say (``lag``): only
    where no rollback of that step will read them back. Called from the thread that runs a
    step (the training thread, backward's, or the optimizer's worker), one run at a time."""

    def __init__(
        self,
        parts: OptimizerParts,
        deferred: DeferredSteps,
        speculation: Speculation,
    ) -> None:
        self.parts = parts
        self._deferred = deferred
        self._speculation = speculation
        self._scratch_on_cpu = parts.compute_device.type == "cpu"

    def commit_due(self) -> bool:
        """Whether the step under way (or about to start) ends with a commit."""
        return self.parts.commits.due(self.parts.state.steps + 1)

    def new_plan(self, *, lag: bool) -> StepPlan:
        """A new step's plan over the layout's slots, writing the parameters the store keeps
        when a commit is due; with ``lag`` (no rollback of this step will read them back) a
        kept parameter's master may lag its values until a commit or a savepoint."""
        layout = self.parts.layout
        plan = self.parts.state.new_plan(
            layout.slots, inners=self.parts.inners, groups=self.parts.groups,
            write_params=self.commit_due(), create=self.parts.backend.create,
            chunk_bytes=layout.chunk_bytes,
        )  # fmt: skip
        if lag:
            plan.unwritten = self.parts.state.unwritten_masters
        return plan

    def job(
        self, piece: Slice, held: Container[int] = (), live: Container[int] = (), *, lag: bool
    ) -> Job:
        """``piece``'s pipeline job (:func:`~tierswap.optim.step._slice_job.slice_job`), the
        gradients of the slots in ``held`` in memory, the parameters of those in ``live``
        holding their values when it steps, in a step whose masters may lag (``lag``, as
        :meth:`new_plan`'s: the job and its read started ahead must be made alike)."""
        layout = self.parts.layout
        return slice_job(
            piece, self.parts.state.names, layout.placement, scratch=self._scratch_on_cpu,
            scales_held=layout.held_scales > 0, grads_held=held, live=live,
            masters_lag=lag and self._scratch_on_cpu and not self.commit_due(),
        )  # fmt: skip

    def run(
        self,
        plan: StepPlan,
        pieces: list[Slice],
        *,
        undo: dict[int, Future[Any]] | None = None,
        between: Callable[[], None] | None = None,
    ) -> None:
        """Step ``pieces`` with ``plan`` through the pipeline (reading the held 8-bit scales
        first, once the layout holds them). ``undo`` makes it a speculative run: slice -> the
        write of its pre-step parameters, which its work waits for before changing them (and
        takes from ``undo``); each slice's stamps are recorded, so that it can roll back.
        ``between``: called before each slice and after the last, outside the pipeline's
        calls (the calls a forward hands the worker, which then use the pipeline too); the
        reads of the slices after it are started ahead as the budget allows. A failure marks
        the state failed (some slices may have stepped) and is raised."""
        pipeline = self.parts.backend.pipeline
        try:
            scales = self._scales_job()
            if scales is not None:
                pipeline.hold(scales)  # read once; each slice's work views it
            # with the names the scales hold, without the gradients in memory
            lag = plan.unwritten is not None
            jobs = [self.job(piece, held=plan.held, lag=lag) for piece in pieces]

            def work(job: Job, tensors: dict[Region, torch.Tensor]) -> Any:
                return self.work(plan, job, tensors, undo=undo)

            if between is None:
                pipeline.run(jobs, work)
                return
            for position, job in enumerate(jobs):
                between()
                pipeline.prefetch(jobs[position:])
                pipeline.run([job], work)
            between()
        except BaseException:
            self.parts.state.failed = True  # some slices may have stepped: close() must not commit
            raise

    def prefetch(self, pieces: list[Slice], *, lag: bool) -> None:
        """Start the reads of ``pieces`` (the held scales' first), as far as the budget
        allows; not of a slice whose gradients in the swap space are not all there yet.
        ``lag``: as :meth:`job`'s."""
        scales = self._scales_job()
        jobs = [self.job(piece, lag=lag) for piece in pieces if _grads_kept(piece)]
        self.parts.backend.pipeline.prefetch(jobs if scales is None else [scales, *jobs])

    def work(
        self,
        plan: StepPlan,
        job: Job,
        tensors: dict[Region, torch.Tensor],
        *,
        undo: dict[int, Future[Any]] | None = None,
    ) -> Any:
        """One slice's step, as the pipeline calls it: its regions to write back (not its
        scales when the pipeline holds them: updated in place there). ``undo``: as
        :meth:`run`'s."""
        created = bool(plan.fresh)
        layout, pipeline = self.parts.layout, self.parts.backend.pipeline
        piece = layout.slices[cast(int, job.name)]  # jobs are named by slice index
        held = pipeline.resident(SCALES_JOB) if layout.held_scales else None
        views = scales_views(piece, self.parts.state.names, held or {})
        if undo is not None:
            write = undo.pop(piece.index, None)
            if write is not None:
                write.result()  # the pre-step parameters are on disk before they change
            self._speculation.record(piece.index, stamps_of(plan, piece))  # can roll back
        unread = (*job.unread, *unbuffered_masters(piece, tensors))
        writes = step_slice(plan, piece, {**tensors, **views}, pipeline.scratch(job), unread)
        writes = {region: t for region, t in writes.items() if region not in views}
        self._deferred.done(seg.slot.param for seg in piece.segments if seg.slot.index in plan.live)
        if created:
            trim_heap()  # the first step's state is freed after its write: free it for real
        return writes

    def _scales_job(self) -> Job | None:
        """The job holding the 8-bit scales when the layout holds them
        (:attr:`~tierswap.optim.plan.Layout.held_scales`), for the state that exists."""
        if not self.parts.layout.held_scales:
            return None
        return scales_job(self.parts.layout.slots, self.parts.state.names)


def _grads_kept(piece: Slice) -> bool:
    """Whether every gradient ``piece`` reads from the swap space (a streamed parameter's,
    :attr:`~tierswap.optim.plan.Slot.keeps_grad`) is there: its read may start."""
    return all(seg.slot.param.grad is not None for seg in piece.segments if seg.slot.keeps_grad)
