"""How a SwapOptimizer's step runs its slices: in ``step()``, in backward, or into forward.

One :class:`Stepper` per optimizer turns a step into pipeline jobs, one per slice, and hands
each slice's work to :func:`~tierswap.optim.step._slice_work.step_slice`. When the work runs depends
on ``overlap``:

- ``None`` (default): each parameter's gradient hook starts the reads of its slices; ``step()``
  steps them all (:meth:`Stepper.step_now`).
- ``"backward"``: the hook steps each slice whose parameters' gradients are all final, and
  ``step()`` steps what is left.
- ``"forward"``: ``step()`` freezes what the step needs and hands the slices, in forward order,
  to the worker of :class:`~tierswap.optim.step.DeferredSteps` (:meth:`Stepper.schedule`);
  the first gradient hook of the next backward starts the next step's reads.

A step ends with its scalar state kept and, when the commit clock says so, a commit.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

import torch

from tierswap.optim.persist import OptimizerParts, commit
from tierswap.optim.plan import Layout, Slice, StepPlan, interleave
from tierswap.optim.step._deferred import DeferredSteps, frozen_group
from tierswap.optim.step._memory import step_allocations, trim_heap
from tierswap.optim.step._slice_work import (
    SCALES_JOB,
    scales_job,
    scales_views,
    slice_job,
    step_slice,
)
from tierswap.pipeline import Job, Region

__all__ = ["Stepper"]


class Stepper:
    """Runs the steps of one optimizer over its parts (:class:`~tierswap.optim.persist.
    OptimizerParts`: the store, the layout, the step bookkeeping, the commit clock, the torch
    optimizer of each group and the param groups), which the optimizer owns.

    It owns the optimizer's worker (:attr:`deferred`, for ``overlap="forward"`` and
    ``"backward"``) and what a step under way knows of the gradient hooks. Called from the
    training thread (``step()`` and the hooks), and from the worker for the slices it runs.
    """

    def __init__(self, parts: OptimizerParts) -> None:
        self.parts = parts
        #: The worker: the step that runs into the next forward (``overlap="forward"``), the
        #: slices that step during backward (``overlap="backward"``).
        self.deferred = DeferredSteps()
        if parts.config.overlap == "forward":
            self.deferred.hook_modules()
        self._scratch_on_cpu = parts.compute_device.type == "cpu"
        self._grad_counts: dict[int, int] = {}  # backward passes seen per slot (accumulation)
        self._final: set[int] = set()  # slots whose gradient is final in this step
        self._queued: set[int] = set()  # overlap="backward": slices handed to the worker
        self._read_ahead = False  # overlap="forward": this backward started the step's reads

    @property
    def layout(self) -> Layout:
        """The layout the steps run over (the parts', replaced when it changes)."""
        return self.parts.layout

    # -- step() ---------------------------------------------------------------------------
    def step_now(self) -> None:
        """Step every slice whose parameters have gradients, here and now; commit when due."""
        due = self.commit_due()
        live = self._live_slots()
        pieces = [
            piece
            for piece in self.layout.slices
            if piece.index not in self.parts.state.stepped
            and any(s.index in live for s in piece.slots)
        ]
        pieces = interleave(pieces, self.layout.placement)
        try:
            self._step_slices(pieces, live)
            if self.parts.config.overlap == "backward":  # the step consumes gradients, as in hooks
                for index in live:
                    self.layout.slots[index].param.grad = None
        finally:
            self.parts.backend.pipeline.release()
            plan, self.parts.state.plan = self.parts.state.plan, None
            self.parts.state.stepped.clear()
            self._final.clear()
            self._queued.clear()
        self.parts.state.steps += 1
        self._end_step(plan, due)

    def schedule(self) -> None:
        """``overlap="forward"``: freeze what the step needs now (gradients, hyper-parameters),
        then step the slices on the worker, in forward order, and commit there when due."""
        due = self.commit_due()
        live = self._live_slots()
        pieces = [p for p in self.layout.slices[::-1] if any(s.index in live for s in p.slots)]
        plan = self._new_plan()
        plan.live |= live
        plan.groups = [frozen_group(group) for group in self.parts.groups]  # the scheduler moves on
        plan.grads = {index: self.layout.slots[index].param.grad for index in live}
        self._read_ahead = False  # the next backward starts the next step's reads
        counts: Counter[int] = Counter()
        for piece in pieces:
            counts.update({id(seg.slot.param) for seg in piece.segments if seg.slot.index in live})
        self.parts.state.steps += 1

        def run() -> None:
            with step_allocations():
                try:
                    self._run_slices(plan, pieces)
                finally:
                    self.parts.backend.pipeline.release()
                self._end_step(plan, due)

        self.deferred.start(counts, run)

    def commit_due(self) -> bool:
        """Whether the step under way (or about to start) ends with a commit."""
        return self.parts.commits.due(self.parts.state.steps + 1)

    def _live_slots(self) -> set[int]:
        """The slots this step updates: those whose parameter has a gradient."""
        return {s.index for s in self.layout.slots if s.param.grad is not None}

    def _end_step(self, plan: StepPlan | None, due: bool) -> None:
        """After a step's slices: keep their scalar state, note which params they wrote, and
        commit when due (``step()``, or the worker of ``overlap="forward"``)."""
        if plan is not None:
            self.parts.state.small.update(plan.small_after)  # only now: hooks share small_before
        # Stepped params without a master were written with their slices when a commit is due.
        self.parts.state.params_written = (
            plan.live if plan is not None and plan.write_params else set()
        )
        self.parts.commits.stepped()
        if due:
            commit(self.parts)

    # -- gradient hooks -------------------------------------------------------------------
    def grad_final(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final (its post-accumulate-grad hook).

        Starts the reads of its slices (as far as the budget allows), or, with
        ``overlap="backward"``, hands the worker each of its slices whose parameters' gradients
        are all final (every ``accumulation_steps`` backward passes) and returns: backward goes
        on while they step (:meth:`_step_in_backward`).
        """
        layout = self.layout
        slot = layout.slot_of.get(id(param))
        if slot is None or self.parts.backend.closed:
            return
        if self.parts.config.overlap == "forward":  # read ahead now for the next step, in its order
            if not self._read_ahead and not self.deferred.busy:
                self._read_ahead = True
                self._prefetch(layout.slices[::-1])
            return
        if self.parts.config.overlap != "backward":
            self._prefetch(layout.slices_of[slot.index])
            return
        count = self._grad_counts[slot.index] = self._grad_counts.get(slot.index, 0) + 1
        if count % self.parts.config.accumulation_steps:
            return
        self._final.add(slot.index)
        ready = [p for p in layout.slices_of[slot.index] if self._ready_in_backward(p)]
        if ready:
            self._queued.update(piece.index for piece in ready)
            self.deferred.queue(lambda: self._step_in_backward(layout, ready))

    def _step_in_backward(self, layout: Layout, ready: list[Slice]) -> None:
        """On the worker, during backward: step ``ready``, then free the gradients of the
        parameters whose slices have all stepped."""
        with torch.no_grad(), step_allocations():
            self._step_slices(ready)
        for index in {seg.slot.index for piece in ready for seg in piece.segments}:
            if all(p.index in self.parts.state.stepped for p in layout.slices_of[index]):
                layout.slots[index].param.grad = None

    def _ready_in_backward(self, piece: Slice) -> bool:
        """Not yet handed to the worker, and every parameter that will get a gradient has its
        final one."""
        return piece.index not in self._queued and all(
            seg.slot.index in self._final or not seg.slot.param.requires_grad
            for seg in piece.segments
        )

    # -- slices through the pipeline ------------------------------------------------------
    def _step_slices(self, pieces: list[Slice], live: set[int] | None = None) -> None:
        """Step ``pieces`` through the pipeline (from ``step()`` or a backward hook)."""
        plan = self.parts.state.plan
        if plan is None:
            plan = self.parts.state.plan = self._new_plan()
        plan.live |= live if live is not None else {s.index for p in pieces for s in p.slots}
        self._run_slices(plan, pieces)
        self.parts.state.stepped.update(piece.index for piece in pieces)

    def _run_slices(self, plan: StepPlan, pieces: list[Slice]) -> None:
        """Stream ``pieces`` through the pipeline, each stepped by :meth:`work` with ``plan``
        (and the held 8-bit scales, read here once the layout holds them)."""
        pipeline = self.parts.backend.pipeline
        try:
            scales = self._scales_job()
            if scales is not None:
                pipeline.hold(scales)  # read once; each slice's work views it
            jobs = [self._job(piece) for piece in pieces]  # with the names the scales hold
            pipeline.run(jobs, lambda job, tensors: self.work(plan, job, tensors))
        except BaseException:
            self.parts.state.failed = True  # some slices may have stepped: close() must not commit
            raise

    def _prefetch(self, pieces: list[Slice]) -> None:
        """Start the reads of ``pieces`` (the held scales' first), as far as the budget
        allows."""
        scales = self._scales_job()
        jobs = [self._job(piece) for piece in pieces]
        self.parts.backend.pipeline.prefetch(jobs if scales is None else [scales, *jobs])

    def _scales_job(self) -> Job | None:
        """The job holding the 8-bit scales when the layout holds them
        (:attr:`~tierswap.optim.plan.Layout.held_scales`), for the state that exists."""
        if not self.layout.held_scales:
            return None
        return scales_job(self.layout.slots, self.parts.state.names)

    def _new_plan(self) -> StepPlan:
        return self.parts.state.new_plan(
            self.layout.slots, inners=self.parts.inners, groups=self.parts.groups,
            write_params=self.commit_due(), create=self.parts.backend.create,
            chunk_bytes=self.layout.chunk_bytes,
        )  # fmt: skip

    def _job(self, piece: Slice) -> Job:
        return slice_job(
            piece, self.parts.state.names, self.layout.placement, scratch=self._scratch_on_cpu,
            scales_held=self.layout.held_scales > 0,
        )  # fmt: skip

    def work(self, plan: StepPlan, job: Job, tensors: dict[Region, torch.Tensor]) -> Any:
        """One slice's step, as the pipeline calls it: its regions to write back (not its
        scales when the pipeline holds them: updated in place there)."""
        created = bool(plan.fresh)
        piece = self.layout.slices[cast(int, job.name)]  # jobs are named by slice index
        pipeline = self.parts.backend.pipeline
        held = pipeline.resident(SCALES_JOB) if self.layout.held_scales else None
        views = scales_views(piece, self.parts.state.names, held or {})
        writes = step_slice(plan, piece, {**tensors, **views}, pipeline.scratch(job))
        writes = {region: t for region, t in writes.items() if region not in views}
        self.deferred.done(seg.slot.param for seg in piece.segments if seg.slot.index in plan.live)
        if created:
            trim_heap()  # the first step's state is freed after its write: free it for real
        return writes
