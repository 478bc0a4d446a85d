"""How a SwapOptimizer's step runs its slices: in backward (checked), in ``step()``, or into
forward.

One :class:`Stepper` per optimizer decides when a step's slices run; its
:class:`~tierswap.optim.step._runner.SliceRunner` runs them through the pipeline, one job per
slice. When they run depends on ``overlap``:

- ``"auto"`` (default): each gradient hook hands the slices whose gradients are all final to
  the worker, which steps them during backward, *speculatively*; ``step()`` checks them
  (:mod:`~tierswap.optim.step._speculation`), rolls the wrong ones back to their pre-step
  state, redoes them and steps the rest, and returns with every parameter updated
  (:meth:`Stepper.step_checked`). Where it cannot speculate (the first step, resident slices
  changed since the last commit, speculation paused, 8-bit state, a scratch store) the hooks
  start reads, as with ``None``.
  With streamed parameters the hook steps the slices itself, with the gradients in memory,
  while the next slices' state is read ahead.
- ``"forward"``: the same speculation in backward, but ``step()`` hands the redoing and the
  rest to the worker and returns; they step, in forward order, while the next forward runs,
  each module waiting for its own parameters.
- ``None``: no overlap: each parameter's gradient hook starts the reads of its slices;
  ``step()`` steps them all (:meth:`Stepper.step_now`).
- ``"backward"``: the hook steps each slice whose parameters' gradients are all final, and
  ``step()`` steps what is left; nothing checks them (no global clipping, no ``GradScaler``).

A step ends with its scalar state kept and, when the commit clock says so, a commit.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tierswap._threads import elementwise, step_threads
from tierswap.optim.persist import (
    OptimizerParts,
    commit,
    commit_behind,
    hyper_parameters,
    restore_params,
    write_lagging_masters,
)
from tierswap.optim.plan import Layout, Slice, StepPlan, flat, interleave
from tierswap.optim.step._deferred import DeferredSteps, frozen_group, own_parameters
from tierswap.optim.step._held import HeldGradients
from tierswap.optim.step._memory import step_allocations
from tierswap.optim.step._runner import SliceRunner
from tierswap.optim.step._slice_job import slice_reads
from tierswap.optim.step._speculation import Speculation, reduced_after_backward, same_groups
from tierswap.pipeline import Job, Region

__all__ = ["Stepper"]


class Stepper:
    """Runs the steps of one optimizer over its parts (:class:`~tierswap.optim.persist.
    OptimizerParts`: the store, the layout, the step bookkeeping, the commit clock, the torch
    optimizer of each group and the param groups), which the optimizer owns.

    It owns the optimizer's worker (:attr:`deferred`: speculative slices, the slices of
    ``overlap="backward"``, the step that runs into the next forward), the :attr:`runner` that
    takes slices through the pipeline, and what a step under way knows of the gradient hooks.
    Called from the training thread (``step()`` and the hooks), and from the worker for the
    slices it runs.
    """

    def __init__(self, parts: OptimizerParts) -> None:
        self.parts = parts
        #: The worker: the slices that step during backward, the step that runs into the next
        #: forward (``overlap="forward"``).
        self.deferred = DeferredSteps()
        config = parts.config
        self._speculative = config.overlap in ("auto", "forward")  # speculates, step() checks
        self._ends_in_step = config.overlap != "forward"  # step() returns with the step done
        if self._speculative:
            self.deferred.hook_modules(
                weakref.WeakMethod(self._before_forward), wait=not self._ends_in_step
            )
        self._grad_counts: dict[int, int] = {}  # backward passes seen per slot (accumulation)
        self._final: set[int] = set()  # slots whose gradient is final in this step
        self._queued: set[int] = set()  # slices handed to the worker in backward
        self._read_ahead = False  # overlap="forward": this backward started the step's reads
        #: The speculative slices and the schedule's record. Speculation needs a store
        #: that keeps versions (durable), state a slice owns whole (not 8-bit scales), and
        #: gradients final in backward (not DDP's, averaged when backward ends).
        self.speculation = Speculation(
            self._speculative
            and config.durable
            and config.state_precision != "8bit"
            and not reduced_after_backward(parts.layout.slots)
        )
        #: Runs the slices through the pipeline, whenever they step.
        self.runner = SliceRunner(parts, self.deferred, self.speculation)
        #: Streamed parameters (``offload_parameters``): speculative slices step in the
        #: gradient hook, on the thread backward runs on, which also streams the parameters
        #: through the pipeline (one thread uses it at a time), with each gradient from
        #: memory (:attr:`_held`), while the reads of the next slices' state run ahead.
        self._inline = config.offload_parameters
        self._held = HeldGradients()
        #: Backward passes per step (learnt when speculating).
        self._passes = config.accumulation_steps
        self._blocked = False  # a forward ran after speculation began: none this step
        self._spec_params: set[int] = set()  # id() of the params speculative slices changed

    @property
    def speculative(self) -> bool:
        """Whether the schedule steps slices speculatively (``overlap="auto"`` or
        ``"forward"``): what :attr:`speculation` records applies to it."""
        return self._speculative

    @property
    def layout(self) -> Layout:
        """The layout the steps run over (the parts', replaced when it changes)."""
        return self.parts.layout

    # -- step() ---------------------------------------------------------------------------
    def step_now(self) -> None:
        """Step every slice whose parameters have gradients, here and now; commit when due."""
        due = self.runner.commit_due()
        live = self._live_slots()
        pieces = [
            piece
            for piece in self.layout.slices
            if piece.index not in self.parts.state.stepped
            and any(s.index in live for s in piece.slots)
        ]
        pieces = interleave(pieces, self.layout.placement)
        try:
            with step_threads(self._fewer_threads(pieces)):
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
            self._held.clear()
        self.parts.state.steps += 1
        self._end_step(plan, due)

    def read_ahead_backward(self) -> None:
        """Streamed parameters stepping in backward (``overlap="backward"``): start the reads
        of the slices that step first in the next backward, for forward to hide. For a
        forward that reads no parameter: those reads would take the room back, and these be
        read again."""
        if self._inline and self.parts.config.overlap == "backward":
            self._held.read_ahead(self.layout, self.parts.backend.pipeline, self._job_ahead)

    def step_checked(self) -> None:
        """``overlap="auto"`` and ``"forward"``: check the slices stepped in backward against
        what the step sees now (gradients, hyper-parameters); roll the wrong ones back and
        redo them, step those not stepped yet, and commit when due. ``"auto"`` does so here,
        in backward order; ``"forward"`` hands it to the worker, in forward order, while the
        next forward runs (each module waits for its own parameters)."""
        layout, state, spec = self.layout, self.parts.state, self.speculation
        due = self.runner.commit_due()
        live = self._live_slots()
        grads = {s.index: s.param.grad for s in layout.slots}
        groups = [frozen_group(group) for group in self.parts.groups]
        now = [hyper_parameters(g) for g in groups]
        same = same_groups(spec.groups or now, now)
        wrong = spec.wrong(layout.slices, grads, same, state.grad_edits)
        kept = set(spec.stamps) - wrong
        redo = [layout.slices[index] for index in sorted(wrong)]
        pieces = [
            p
            for p in layout.slices
            if p.index not in kept and (p.index in wrong or any(s.index in live for s in p.slots))
        ]
        pieces = interleave(pieces, layout.placement) if self._ends_in_step else pieces[::-1]
        plan = self._checked_plan(live, due, groups, grads, redo)
        written = plan.live - {seg.slot.index for i in kept for seg in layout.slices[i].segments}
        rolled = [seg for piece in redo for seg in piece.segments]
        speculated = spec.pending  # the store holds the savepoint
        spec.close_step(
            state.steps + 1, speculated=len(spec.stamps), redone=len(redo), after=len(pieces)
        )
        self._spec_params.clear()
        self._end_backward()
        state.steps += 1

        fewer = self._ends_in_step and self._fewer_threads(pieces)  # on this thread
        # streamed parameters: the forward's hooks read through the pipeline the step uses, so
        # the worker serves them between its slices
        serves = not self._ends_in_step and self._inline
        between = self.deferred.between if serves else None

        def run() -> None:
            with torch.no_grad(), step_allocations(), step_threads(fewer):
                try:
                    if redo:
                        self._roll_back(redo)
                        # (those with a gradient now stay pending until they step again)
                        self.deferred.done(seg.slot.param for seg in rolled)
                    if speculated:
                        self.parts.backend.release_savepoint()
                    self.runner.run(plan, pieces, between=between)
                except BaseException:
                    state.failed = True  # parameters or state half rolled back
                    state.steps -= 1  # not taken (a loaded state continues from the one before)
                    raise
                finally:
                    self.parts.backend.pipeline.release()
                    # the slices have read them: with "forward" the commit may still run here
                    # while the next backward makes new ones
                    plan.grads = None
                self._end_step(plan, due, written)

        if self._ends_in_step:
            run()
            return
        counts: Counter[int] = Counter(id(seg.slot.param) for seg in rolled)
        for piece in pieces:
            counts.update({id(seg.slot.param) for seg in piece.segments if seg.slot.index in live})
        self.deferred.start(counts, run, serves=serves)

    def _fewer_threads(self, pieces: list[Slice]) -> bool:
        """Whether a step of ``pieces`` on ``step()``'s thread, with nothing of tierswap's
        computing beside it, runs on half of torch's threads (:mod:`tierswap._threads`): its
        torch optimizers are elementwise and some of the slices stream, so the I/O threads
        need cores beside it."""
        placement = self.layout.placement
        streams = any(piece.index not in placement for piece in pieces)
        return streams and elementwise(self.parts.inners)

    def _checked_plan(
        self,
        live: set[int],
        due: bool,
        groups: list[dict[str, Any]],
        grads: dict[int, torch.Tensor | None],
        redo: list[Slice],
    ) -> StepPlan:
        """The plan of a checked step (the one made ahead, or a new one) for the ``live``
        slots, their gradients and the ``groups`` of now; ``redo``'s slices step again with
        the live set of now."""
        state = self.parts.state
        plan = state.plan if state.plan is not None else self.runner.new_plan(lag=self._lags())
        state.plan = None
        plan.live = set(live)
        plan.write_params = due
        plan.groups = groups
        plan.grads = {index: grads[index] for index in live}
        plan.held = {}  # what is left reads the kept gradients, edited as recorded by now
        plan.grad_edits = {i: tuple(e) for i, e in state.grad_edits.items()}
        for piece in redo:
            for slot in piece.slots:
                plan.small_after.pop(slot.index, None)
        return plan

    def _roll_back(self, pieces: list[Slice]) -> None:
        """Return ``pieces`` to their pre-step state: the store's regions to the savepoint,
        each parameter they stepped to its pre-step value."""
        names, backend = self.parts.state.names, self.parts.backend
        # not the kept gradients: written since the savepoint, the redone step reads them
        reads = {piece.index: slice_reads(piece, names, kept_grads=False) for piece in pieces}
        backend.roll_back(region for regions in reads.values() for region in regions)
        for index, regions in reads.items():  # a resident slice's tensors: as stored
            backend.pipeline.reload(index, regions)
        restore_params(self.parts, [seg for piece in pieces for seg in piece.segments])

    def end_speculation(self) -> None:
        """``step()`` starts: the slices handed over in backward that the worker has not
        started will step with the rest (they need no speculation any more); wait for the
        others, and raise a failure of theirs (after rolling back what was speculated: that
        step is not taken)."""
        if self._speculative:
            self.deferred.cancel_queued()
        try:
            self.deferred.wait()
        except BaseException as failure:
            if self._speculative:
                self._undo_speculation(failure)
            raise

    def gradients_dropped(self) -> None:
        """``zero_grad()``: the gradients of this step go, whether it was taken or not (a
        ``GradScaler`` skipped it): roll back what was speculated for it, and count backward
        passes anew."""
        if not self._speculative:
            self._held.clear()  # ("backward": the streamed gradients of slices not stepped)
            return
        if self._queued or self.speculation.pending:
            self.end_speculation()
            self.abandon()
        self._end_backward(learn=False)

    def abandon(self) -> None:
        """Speculation (``"auto"``, ``"forward"``): the step that slices were speculated for
        is not taken (a forward ran first, the gradients were dropped, the state was asked
        for): roll them back, so that parameters and state are as before the step. A failure
        of the worker is raised after that (the slices it stepped are rolled back all the
        same)."""
        try:
            self.deferred.wait()
        except BaseException as failure:
            self._undo_speculation(failure)
            raise
        self._undo_speculation(None)

    def _undo_speculation(self, failure: BaseException | None) -> None:
        """Roll the speculated slices back and forget them. After the worker's ``failure``
        (raised by the caller), drop what its slices read ahead, and let a rollback that
        fails too only mark the state failed."""
        spec, state = self.speculation, self.parts.state
        if failure is not None:
            self.parts.backend.pipeline.release()
        if not spec.pending:
            return
        try:
            self._roll_back([self.layout.slices[index] for index in sorted(spec.stamps)])
            self.parts.backend.release_savepoint()
        except BaseException:
            state.failed = True  # the parameters may hold the speculative values
            if failure is None:
                raise
        finally:
            spec.forget()
            self._spec_params.clear()
            state.plan = None
            state.stepped.clear()
            self._queued.clear()
            self._final.clear()
            self._held.clear()

    def _before_forward(self, module: torch.nn.Module) -> None:
        """``module`` is about to run forward: if speculative slices changed one of its
        parameters (:func:`~tierswap.optim.step._deferred.own_parameters`), the step they
        belong to was not taken yet (gradient accumulation, an evaluation): roll them back,
        and speculate no more in this step (the next learns how many backward passes a step
        takes)."""
        if self._spec_params and any(id(p) in self._spec_params for p in own_parameters(module)):
            self._blocked = True
            self.abandon()

    def _end_backward(self, *, learn: bool = True) -> None:
        """A step took its gradients (or, without ``learn``, they were dropped): learn how
        many backward passes it took (when speculating), and start counting anew."""
        if (
            learn
            and self._speculative
            and self._grad_counts
            and self.parts.config.accumulation_steps == 1
        ):
            self._passes = max(self._grad_counts.values())
        self._grad_counts.clear()
        self._final.clear()
        self._queued.clear()
        self._held.clear()
        self._blocked = False
        self._read_ahead = False
        self.parts.state.stepped.clear()

    def _lags(self) -> bool:
        """Whether the slices this step runs from now on may let the masters of kept
        parameters lag their values: no rollback of this step reads them back, since none of
        its slices speculates (a schedule that never speculates, or speculation paused or
        blocked for this step). The next savepoint writes them first (:meth:`_speculate`)."""
        spec = self.speculation
        return (
            not self._speculative or self._blocked or not spec.allowed(self.parts.state.steps + 1)
        )

    def _live_slots(self) -> set[int]:
        """The slots this step updates: those whose parameter has a gradient."""
        return {s.index for s in self.layout.slots if s.param.grad is not None}

    def _end_step(self, plan: StepPlan | None, due: bool, written: set[int] | None = None) -> None:
        """After a step's slices: keep their scalar state, note which params they wrote, and
        commit when due (``step()``, or the worker). ``written``: the live slots whose slices
        all stepped with ``plan`` (not speculatively), when not all did."""
        if plan is not None:
            self.parts.state.small.update(plan.small_after)  # only now: hooks share small_before
        # Stepped params without a master were written with their slices when a commit is due.
        self.parts.state.params_written = (
            (plan.live if written is None else written)
            if plan is not None and plan.write_params
            else set()
        )
        self.parts.state.grad_edits.clear()  # they edited this step's gradients
        self.parts.commits.stepped()
        if due and self.parts.commits.behind():  # "auto", and the forward leaves the CPU idle
            commit_behind(self.parts)  # the swap space's next use waits, the forward need not
        elif due:  # commit_every=N, or a forward that keeps the CPU busy: it ends here
            commit(self.parts)

    # -- gradient hooks -------------------------------------------------------------------
    def grad_final(
        self,
        param: torch.Tensor,
        grad: torch.Tensor | None = None,
        *,
        done: Callable[[], None] = lambda: None,
    ) -> None:
        """``param``'s gradient is final (its post-accumulate-grad hook); ``grad``: a
        streamed parameter's, which left ``param.grad`` for the swap space.

        Starts the reads of its slices (as far as the budget allows), or, with
        ``overlap="backward"``, hands the worker each of its slices whose parameters' gradients
        are all final (every ``accumulation_steps`` backward passes) and returns: backward goes
        on while they step (:meth:`_step_in_backward`).

        ``done`` frees a streamed parameter's values (the stream's ``grad_done``; the caller
        calls it after this returns too): called before reads for a later step start, so
        that their jobs read what that step will need (the master of a parameter freed by then).
        """
        layout = self.layout
        slot = layout.slot_of.get(id(param))
        if slot is None or self.parts.backend.closed:
            return
        overlap = self.parts.config.overlap
        if self._speculative:
            self._grad_speculative(layout, slot.index, grad, done)
            return
        if overlap != "backward":
            done()
            self.runner.prefetch(layout.slices_of[slot.index], lag=self._lags())
            return
        count = self._grad_counts[slot.index] = self._grad_counts.get(slot.index, 0) + 1
        if count % self.parts.config.accumulation_steps:
            return
        self._final.add(slot.index)
        if grad is not None:
            self._held.grads[slot.index] = grad
        ready = [p for p in layout.slices_of[slot.index] if self._ready_in_backward(p)]
        self._step_ready(layout, ready, lambda pieces: self._step_in_backward(layout, pieces))

    def keeps_grad(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s streamed gradient, final in this backward pass, must be kept
        in the swap space: not with ``overlap="backward"`` on a step's last pass (its slices
        step with it from memory, and nothing checks or redoes them)."""
        slot = self.layout.slot_of.get(id(param))
        if self.parts.config.overlap != "backward" or slot is None:
            return True
        return (
            self._grad_counts.get(slot.index, 0) + 1
        ) % self.parts.config.accumulation_steps != 0

    def _read_ahead_forward(self, layout: Layout) -> None:
        """Once per backward: start the reads of the next step's first slices, in forward
        order (unless the worker still steps the previous step)."""
        if not self._read_ahead and not self.deferred.busy:
            self._read_ahead = True
            self.runner.prefetch(layout.slices[::-1], lag=self._lags())

    def _grad_speculative(
        self, layout: Layout, index: int, grad: torch.Tensor | None, done: Callable[[], None]
    ) -> None:
        """Speculation: hand the worker the slices this gradient makes ready (streamed
        parameters: step them here, ``grad`` in memory), when this step speculates and this
        is the step's last backward pass; else (``done`` first) read ahead."""
        count = self._grad_counts[index] = self._grad_counts.get(index, 0) + 1
        lags = self._lags()  # (here: speculation paused or blocked for this step)
        if lags or count != self._passes:
            done()
            if self._ends_in_step:
                self.runner.prefetch(layout.slices_of[index], lag=lags)
            else:
                self._read_ahead_forward(layout)
            return
        self._final.add(index)
        ready = [
            p for p in layout.slices_of[index] if self._ready_in_backward(p) and self._speculable(p)
        ]
        if grad is not None and any(map(self._speculable, layout.slices_of[index])):
            self._held.grads[index] = grad
        self._spec_params.update(id(seg.slot.param) for p in ready for seg in p.segments)
        self._step_ready(layout, ready, self._speculate)

    def _step_ready(
        self, layout: Layout, ready: list[Slice], step: Callable[[list[Slice]], None]
    ) -> None:
        """Backward made ``ready`` ready: hand them to the worker to ``step``, or, with
        streamed parameters, step them here, let their gradients go, and read the next
        slices' state ahead."""
        if ready:
            self._queued.update(piece.index for piece in ready)
            if not self._inline:
                self.deferred.queue(lambda: step(ready))
                return
            step(ready)
            self._held.let_go(layout, ready, self._waits_in_backward)
        if self._inline:
            self._held.read_ahead(layout, self.parts.backend.pipeline, self._job_ahead)

    def _waits_in_backward(self, piece: Slice) -> bool:
        """Whether ``piece`` is still to step in backward with its gradients in memory: not
        handed over yet, and (when this step speculates) one that speculates; the others
        step after backward from the kept gradients (:meth:`_checked_plan`)."""
        if piece.index in self._queued:
            return False
        return not self._speculative or self._speculable(piece)

    def _job_ahead(self, piece: Slice) -> Job | None:
        """The job of ``piece`` to read ahead in backward (its gradients will be in
        memory), unless it was handed over or does not step there."""
        if piece.index in self._queued or not self._speculable(piece):
            return None
        slots = {seg.slot.index for seg in piece.segments}
        # a slice of one parameter steps when its gradient is final, which the parameter
        # holds its values for (the stream frees it after): its master is not read
        live = slots if len(slots) == 1 else ()
        return self.runner.job(piece, held=slots, live=live, lag=self._lags())

    def _speculable(self, piece: Slice) -> bool:
        """A slice whose parameters all have state (a first step creates it) and whose
        pre-step values the store holds without a write of this step, for a rollback to
        return to: one that streams, or a resident one whose tensors have not changed since a
        commit flushed them (the step before committed), beside parameters that have masters
        or stream. (A resident slice stepping after backward writes nothing: speculating must
        not write pre-step copies of parameters either, :meth:`_write_pre_step_params`.)

        Not a resident one while the step before still runs on the worker (``"forward"``:
        the forward waited for the parameters alone): the pipeline is the worker's then, and
        the step may not have kept the slice's results yet, so the pipeline would tell a
        store one step behind for current."""
        names, pipeline = self.parts.state.names, self.parts.backend.pipeline
        if piece.index in self.layout.placement and (
            self.deferred.busy
            or pipeline.unflushed(piece.index)
            or any(seg.slot.persists_param and not seg.slot.streamed for seg in piece.segments)
        ):
            return False
        return all(
            names.get(seg.slot.index) for seg in piece.segments if seg.slot.param.requires_grad
        )

    def _speculate(self, ready: list[Slice]) -> None:
        """On the worker, during backward: step ``ready`` speculatively (the first of a step
        sets the store's savepoint and the step's plan)."""
        state = self.parts.state
        if self._blocked:
            return
        with torch.no_grad(), step_allocations():
            if state.plan is None:
                # a rollback restores kept parameters from their stored masters: those that
                # steps without speculation let lag reach the store before its savepoint
                write_lagging_masters(self.parts)
                self.parts.backend.savepoint()
                self.speculation.begin([hyper_parameters(g) for g in self.parts.groups])
                state.plan = self.runner.new_plan(lag=False)
                state.plan.write_params = False  # the pre-step copies are written instead
            plan = state.plan
            plan.held = self._held.grads
            plan.live |= {
                seg.slot.index
                for p in ready
                for seg in p.segments
                if seg.slot.param.grad is not None
            }
            undo = self._write_pre_step_params(ready, plan)
            try:
                self.runner.run(plan, ready, undo=undo)
            finally:
                for future in undo.values():  # (a slice that failed before its work)
                    future.exception()
            state.stepped.update(piece.index for piece in ready)

    def _write_pre_step_params(self, pieces: list[Slice], plan: StepPlan) -> dict[int, Future[Any]]:
        """Start writing the pre-step value of each live parameter of ``pieces`` that the
        store keeps (:attr:`~tierswap.optim.plan.Slot.persists_param`: no master, or a
        remainder) under its :attr:`~tierswap.optim.plan.Slot.param_key`, straight from the
        parameter's memory: what a rollback restores it from (a streamed one's stored values
        are in the store's savepoint already). Each slice's work waits for its
        own before it changes the parameter (:meth:`SliceRunner.work`); by then it is mostly
        done."""
        writes = {}
        for piece in pieces:
            regions = {
                Region(seg.slot.param_key, seg.start, seg.stop): flat(seg.slot.param)[
                    seg.start : seg.stop
                ].detach()
                for seg in piece.segments
                if seg.slot.index in plan.live and seg.slot.persists_param and not seg.slot.streamed
            }
            if regions:
                writes[piece.index] = self.parts.backend.put_regions_async(regions)
        return writes

    def _step_in_backward(self, layout: Layout, ready: list[Slice]) -> None:
        """On the worker (streamed parameters: in the hook), during backward: step
        ``ready``, then free the gradients of the parameters whose slices have all stepped
        (a streamed one's stand-in stays until ``step()``: clipping it raises, rather than
        finding no gradient and doing nothing)."""
        with torch.no_grad(), step_allocations():
            self._step_slices(ready)
        for index in {seg.slot.index for piece in ready for seg in piece.segments}:
            slot = layout.slots[index]
            if not slot.streamed and all(
                p.index in self.parts.state.stepped for p in layout.slices_of[index]
            ):
                slot.param.grad = None

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
            plan = self.parts.state.plan = self.runner.new_plan(lag=self._lags())
        plan.live |= live if live is not None else {s.index for p in pieces for s in p.slots}
        plan.held = self._held.grads  # streamed ones not kept in the swap space ("backward")
        self.runner.run(plan, pieces)
        self.parts.state.stepped.update(piece.index for piece in pieces)
