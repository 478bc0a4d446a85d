"""Parameter streaming: each module's parameters hold memory only while the module runs.

With ``offload_parameters=True`` a parameter's values live in the swap space, as the fp32
master its slot keeps (:attr:`~tierswap.optim.plan.Slot.streamed`): the step reads it with
the slice's state, updates it and writes it back, and nothing else holds it. The
:class:`ParameterStream` reads a module's parameters into their own (refilled) memory just
before the module's forward, frees them after it, reads them again when backward reaches the
module (a hook on the module's outputs fires before the module's backward runs) and frees
each one as soon as its gradient is final, or when backward ends.

Where a value comes from: a slice the policy keeps resident (host or device tier) holds the
newest master, copied from there; any other slice's master is read from the store through
the optimizer's :class:`~tierswap.pipeline.Pipeline` (one job per slice segment, within the
host budget, in order after the write-behinds that overlap it). The order in which modules
are used is recorded over the first iteration (up to the first ``step()``); later uses read
the next modules' parameters ahead, as the lookahead policy does for the step's slices
(:mod:`~tierswap.optim.stream._ahead`, dropped when a step begins: it rewrites the masters). On a
GPU the module used next is also copied to the device ahead, once its values are in host memory,
so that its upload hides behind the kernels of the module in use (``_upload_ahead``).

Gradients never pile up: as backward finalizes a parameter's gradient (the optimizer's
post-accumulate-grad hook), the gradient goes to the swap space too
(:class:`~tierswap.optim.stream._gradients.KeptGradients`), and ``param.grad`` gets an
:class:`OffloadedGradient` stand-in, on which torch's clipping and a ``GradScaler``'s unscale
work; the step reads the gradient with the slice's state and applies their factors. A slice
that steps in backward (``overlap="auto"``) takes the gradient from memory instead
(:meth:`ParameterStream.grad_final` returns it), and ``step()`` checks that no factor changed
it; the parameter is freed after that step (:meth:`ParameterStream.grad_done`), which takes
the master from its values, not the store.
Backward passes that accumulate add to the kept gradient, as torch adds into ``param.grad``.

``device_budget`` (on a machine without a GPU, less the room that the parameters leave to the
optimizer's state) holds the parameters in use and keeps others between uses: when some are
done with, those idle ones whose next use in the recorded order comes soonest keep their
values (Belady on the order of uses, :class:`~tierswap.optim.stream._order.UseOrder`, within
what the budget leaves beside those in use; those that fit while the first iteration records
the order), and a read frees kept ones, those used latest first, until it fits beside them;
the step updates a kept parameter in place, so it is read no more. Parameters in use are
never freed: a module larger than the budget takes its own size.

Values written into a parameter outside the optimizer (an init, a clamp: its ``_version``
moves, or its guard reports an edit through ``.data``) are put where its values are kept
before it is freed or a step reads the masters, as a gradient is.

``model.state_dict()`` reads the values from the swap space; ``model.load_state_dict()`` gives
each module's parameters their values while it loads and writes what was loaded as their
masters. A ``master="remainder"`` slot's values are its stored bf16 parameter (2 bytes an
element), beside the remainder.

A param group added later (``add_param_group``) streams from then on
(:meth:`ParameterStream.adopt`).

A parameter used where no hook of its modules runs (``nn.MultiheadAttention`` hands
``out_proj.weight`` to its functional form; a parent's forward uses a child's weight; a
penalty on the weights in the training loop) is read for that use: each streamed parameter is
a :class:`~tierswap.optim.stream._guard.StreamedParameter` while the optimizer streams it,
which asks :meth:`ParameterStream.use` before an operation reads its values. Within a forward
the innermost running module (the model itself among them) borrows it: from then on that
module's hooks read it, as they read its own parameters. Outside any forward it keeps its
values until backward ends (autograd may have saved it) or the next step begins.

With ``overlap="forward"`` the step after backward runs on into the next forward, and the
stream's calls into the pipeline from the forward go through its thread
(:mod:`~tierswap.optim.stream._into_forward`).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tierswap.engine import ToDevice
from tierswap.optim.persist import OptimizerParts, write_lagging_masters, write_master
from tierswap.optim.plan import Slot
from tierswap.optim.stream._ahead import ReadsAhead
from tierswap.optim.stream._gradients import KeptGradients
from tierswap.optim.stream._guard import guard, unguard, warn_unguarded
from tierswap.optim.stream._hooks import before_backward, check_owned, hook_modules, owners
from tierswap.optim.stream._into_forward import NoStep, StepIntoForward
from tierswap.optim.stream._order import UseOrder
from tierswap.optim.stream._placeholder import OffloadedGradient
from tierswap.optim.stream._storage import ParameterMemory, nbytes, to_meta
from tierswap.optim.stream._swap import (
    grad_room,
    keep_values,
    landed,
    read_into,
    ready_all,
    uploads_overlap,
)

__all__ = ["PREFETCH_MODULES", "ParameterStream"]

#: Modules whose parameters are read ahead of the one in use.
PREFETCH_MODULES = 2


class ParameterStream:
    """Streams the streamed parameters of ``model`` (slots the optimizer's layout marks
    :attr:`~tierswap.optim.plan.Slot.streamed`) through the optimizer's ``parts``.

    :meth:`start` frees them and hooks the modules; :meth:`close` removes the hooks and reads
    every parameter back. Called from the training thread (forward, ``step()``) and from the
    thread autograd runs backward on, one at a time. ``budget``: the bytes of
    ``device_budget`` for parameters (all of it on a GPU; without one, what the optimizer's
    state does not take of it); ``idle_room``: the bytes of ``host_budget`` where memory freed
    parameters leave may stay idle for the next ones, beside what ``budget`` leaves (on the
    CPU: :func:`~tierswap.optim.stream._storage.idle_room`); ``step``: the optimizer's step
    that runs into the forward (``overlap="forward"``), whose thread the forward's calls into
    the pipeline go through while it runs.
    """

    def __init__(
        self,
        parts: OptimizerParts,
        model: torch.nn.Module,
        meta_born: Iterable[int] = (),
        *,
        budget: int,
        idle_room: int = 0,
        step: StepIntoForward | None = None,
    ) -> None:
        self.parts = parts
        #: The step that runs into the forward: the hooks' reads go through its thread while
        #: it runs (it uses the pipeline), and backward waits for it.
        self._step: StepIntoForward = step if step is not None else NoStep()
        #: The reads of the next modules' parameters started ahead of their use.
        self._ahead = ReadsAhead(parts, self._step)
        #: Slots whose parameter was built on the meta device: :meth:`close` returns it there.
        self._meta_born = set(meta_born)
        #: The model and each module that owns streamed parameters, with the slot indices of
        #: those and of the ones it borrows (:meth:`use`).
        self._modules = owners(model, parts.layout.slot_of)
        self._model = weakref.ref(model)
        self._live: set[int] = set()  # slots whose parameter holds its values now
        self._versions: dict[int, int] = {}  # each live parameter's _version when it got them
        self._edited: set[int] = set()  # live slots written through an alias (``.data``)
        self._users: Counter[int] = Counter()  # forwards running that use each slot
        self._running: list[int] = []  # modules whose forward runs, the innermost last
        self._loose: set[int] = set()  # slots used outside forward: held until backward ends
        self._sizes: dict[int, int] = {}  # bytes of each slot's parameter values
        self._memory = ParameterMemory()
        self._in_backward = False
        self._seen_in_backward: set[int] = set()  # modules backward has reached
        self._order = UseOrder()  # modules in the order of their uses, recorded once
        #: Slots uploaded to the GPU ahead of their module's use: the copies (a list a module).
        self._uploads: dict[int, list[ToDevice]] = {}
        self._handles: list[Any] = []
        #: The bytes of ``device_budget`` for parameters in use and kept between uses.
        self._budget = budget
        #: Host bytes for the memory freed parameters leave idle, beside what the budget leaves.
        self._idle_room = idle_room
        self._kept: set[int] = set()  # slots whose parameter keeps its values between uses
        #: The gradients backward finalized, kept in the swap space until the step.
        self.gradients = KeptGradients(parts, functools.partial(self._read_into, grad=True))
        self.fetched_bytes = 0  # read from the store
        self.copied_bytes = 0  # copied from resident slices
        self.uploaded_ahead_bytes = 0  # of those two, uploaded ahead of their module's use
        self.live_bytes = 0
        self.peak_bytes = 0

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Free every streamed parameter (the store holds its master) and hook the modules."""
        self._take(self._streamed())
        self._hook()

    def _take(self, indices: Iterable[int]) -> None:
        """Free the parameters of slots ``indices`` and guard them (warn of those it cannot)."""
        unguarded = []
        for slot in (self._slot(index) for index in sorted(indices)):
            self._memory.free(slot.param)
            if not guard(slot.param, self, slot.index):
                unguarded.append(slot.name or slot.prefix)
        self._memory.trim(self._room())
        warn_unguarded(unguarded)

    def adopt(self, slots: list[Slot]) -> None:
        """Stream the parameters of ``slots`` too (a param group added; the store holds their
        masters now): free them and hook the modules anew. The positions of the modules
        change, so the order of uses is recorded again over the next iteration, and the
        parameters kept between uses are freed meanwhile (the store has their values)."""
        model = self._model()
        if model is None:
            return
        self._unhook()
        self._ahead.drop()
        self._free(self._kept | set(self._uploads))
        self._kept.clear()
        self._modules = owners(model, self.parts.layout.slot_of)
        self._order.restart()
        self._sizes.clear()  # the layout's slots are numbered anew
        self._take(slot.index for slot in slots)
        self._hook()

    def check_owned(self, slots: list[Slot]) -> None:
        """Raise ``ConfigError`` unless every parameter of ``slots`` is the model's."""
        model = self._model()
        if model is not None:
            check_owned(model, slots)

    def keeps_all(self) -> bool:
        """Whether every streamed parameter holds its values now (kept between uses, as
        ``device_budget`` allows): the next forward reads none."""
        return self._streamed() <= self._live

    def _streamed(self) -> set[int]:
        return {i for _, owned in self._modules for i in owned}

    def _hook(self) -> None:
        """Hook the model, each module that owns streamed parameters, and the model's state
        dict; leave room in the host budget for the gradients backward keeps."""
        self._handles = hook_modules(self, [module for module, _ in self._modules], self._model())
        slots = [self._slot(index) for index in self._streamed()]
        self.parts.backend.pipeline.write_room = grad_room(self.parts.layout, slots)

    def close(self) -> None:
        """Remove the hooks and read every parameter back into its memory (the model is whole
        again, as before the optimizer took it), except those built on the meta device: a
        model that did not fit in memory returns to the meta device (its values stay in the
        swap folder, from which a run resumes)."""
        self._unhook()
        self._ahead.drop()
        for _, owned in self._modules:
            self._fetch([i for i in owned if i not in self._meta_born])
        self._memory.trim(0)
        for index in self._streamed():
            unguard(self._slot(index).param)
        for index in self._meta_born:
            self._live.discard(index)
            to_meta(self._slot(index).param)

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hooks' events -------------------------------------------------------------------
    def before_forward(self, position: int) -> None:
        """Module ``position`` is about to run forward: its parameters must hold values."""
        self._step.serve(functools.partial(self._before_forward, position))

    def _before_forward(self, position: int) -> None:
        owned = self._modules[position][1]
        self._fetch(owned)
        self._used(position)  # reads ahead after its own: they would wait behind those
        self._users.update(owned)
        self._running.append(position)

    def after_forward(self, position: int, output: Any) -> None:
        """Module ``position`` ran forward: free its parameters unless another running forward
        or backward (a checkpoint's recomputation) uses them; hook its outputs so that backward
        reads them again before it reaches the module."""
        owned = self._modules[position][1]
        self._users.subtract(owned)
        if self._running and self._running[-1] == position:  # forwards nest: it is the last
            self._running.pop()
        if not self._in_backward:
            self._step.serve(lambda: self._let_go([i for i in owned if self._users[i] <= 0]))
        if torch.is_grad_enabled():  # (this thread's grad mode, not the step's)
            ref = weakref.ref(self)
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                    hook = functools.partial(before_backward, ref, position)
                    tensor.register_hook(hook)  # type: ignore[no-untyped-call]

    def before_backward(self, position: int) -> None:
        """Backward reached an output of module ``position``: read its parameters (once per
        backward pass); the first call of a pass schedules :meth:`end_backward`."""
        if not self._in_backward:
            self._step.wait()  # a step into the forward: its slices and the kept gradients'
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            self._take_back_gradients()
            # slices may step in backward: their masters hold the values edited since (before
            # a speculative step sets the store's savepoint, which a rollback returns to)
            self._keep_edits(list(self._live))
        if position in self._seen_in_backward:
            return
        self._seen_in_backward.add(position)
        self._fetch(self._modules[position][1])
        self._used(position)

    def grad_final(self, param: torch.Tensor, *, keep: bool = True) -> torch.Tensor | None:
        """``param``'s gradient is final in this backward pass (the optimizer's gradient hook,
        before the step hears of it): keep it in the swap space, added to the one kept since
        the last ``zero_grad()`` (accumulation, as torch adds into ``param.grad``), leave
        :class:`OffloadedGradient` in ``param.grad``. Returns the gradient (a slice may step
        with it now), if any; :meth:`grad_done` then frees the parameter, which backward needs
        no more (a slice stepping in between takes its master from the values). Without
        ``keep`` (``overlap="backward"``, the step's last pass: its slices step with it from
        memory and nothing reads it again) it is not written to the swap space."""
        slot = self.parts.layout.slot_of.get(id(param))
        if slot is None or not slot.streamed:
            return None
        grad = param.grad
        if grad is None or isinstance(grad, OffloadedGradient):
            return None
        self._keep_edits([slot.index])  # its step may read the master now
        grad = self.gradients.take(slot, grad, keep=keep)
        param.grad = OffloadedGradient(param, self.gradients, slot.index)
        return grad

    def grad_done(self, param: torch.Tensor) -> None:
        """The slices that ``param``'s final gradient made ready have stepped: free the
        parameter unless a running module uses it (or ``device_budget`` keeps it)."""
        slot = self.parts.layout.slot_of.get(id(param))
        if slot is not None and slot.streamed and self._users[slot.index] <= 0:
            self._let_go([slot.index])

    def use(self, index: int, *, saved: bool) -> bool:
        """An operation is about to read the parameter of slot ``index`` (its
        :class:`~tierswap.optim.stream._guard.StreamedParameter` asks: it holds no values, or
        autograd may save it, ``saved``): give it its values, unless a running module that
        uses it has; whether they are lent for this operation only.

        The innermost running module borrows it: it is in use until that module's forward
        ends, and from then on that module's hooks read it with their own, in forward and
        backward. Outside any forward, a use that autograd may save (or one in backward)
        keeps it in use until backward ends or a step begins; another one borrows its values
        for the operation (:meth:`used`)."""
        # (a module that reads another's parameter: its forward waited for its own alone)
        self._step.wait_for([self._slot(index).param])
        return self._step.serve(functools.partial(self._use, index, saved=saved))

    def _use(self, index: int, *, saved: bool) -> bool:
        if self._users[index] > 0 and index in self._live:  # a running module's: the most
            return False
        if self._users[index] <= 0:
            if self._running:
                self._modules[self._running[-1]][1].append(index)
            elif self._in_backward or saved:
                self._loose.add(index)
            else:
                lent = index not in self._live
                self._fetch([index])
                return lent
            self._users[index] += 1
        self._fetch([index])  # nothing to do when it holds values
        return False

    def used(self, index: int, *, viewed: bool) -> None:
        """The operation that the values of slot ``index`` were lent for (:meth:`use`) ran:
        let them go, unless its result views them (they then stay until backward ends or a
        step begins)."""
        self._step.serve(functools.partial(self._used_by_one, index, viewed=viewed))

    def _used_by_one(self, index: int, *, viewed: bool) -> None:
        if viewed:
            self._loose.add(index)
            self._users[index] += 1
        elif self._users[index] <= 0:
            self._let_go([index])

    def _release_loose(self) -> list[int]:
        """The parameters used outside forward are not in use any more: those now in no
        use."""
        loose, self._loose = self._loose, set()
        self._users.subtract(loose)
        return [i for i in loose if self._users[i] <= 0]

    def end_backward(self) -> None:
        """Backward ended: free what it read (frozen parameters, which have no gradient
        hook, and those whose gradient never came) and what was used outside forward."""
        self._in_backward = False
        self._seen_in_backward.clear()
        self._release_loose()
        self._let_go([i for i in self._live if self._users[i] <= 0 and i not in self._kept])

    def _take_back_gradients(self) -> None:
        """A backward pass begins: the gradients kept since the last ``zero_grad()`` are the
        ones this pass adds to; their stand-ins leave ``param.grad`` so that autograd stores a
        fresh gradient (torch would add into the old one)."""
        accumulating = set()
        for _, owned in self._modules:
            for index in owned:
                param = self._slot(index).param
                if isinstance(param.grad, OffloadedGradient):
                    accumulating.add(index)
                    param.grad = None
        self.gradients.begin_pass(accumulating)

    def step_begins(self) -> None:
        """A step will rewrite the masters: drop reads started ahead; the first step ends the
        recording of the order of uses."""
        self._step.wait()  # (a step into the forward that no backward waited for)
        self._ahead.drop()
        self._free(list(self._uploads))  # read from the masters the step rewrites
        if self._loose:
            self._let_go(self._release_loose())
        self._keep_edits(list(self._live))  # the step reads the masters, updates the values
        self._order.step_begins([owned for _, owned in self._modules])

    # -- model.load_state_dict() -------------------------------------------------------------
    def before_load(self, position: int) -> None:
        """``load_state_dict()`` is about to copy loaded values into module ``position``'s
        parameters: give them their current values (a key the state dict lacks keeps its
        value). The store must then hold the newest masters alone, since the load rewrites
        them there: resident slices are written back and dropped, reads ahead dropped."""
        self._step.wait()
        self._ahead.drop()
        self.parts.backend.pipeline.evict()
        self._fetch(self._modules[position][1])

    def after_load(self, position: int) -> None:
        """Module ``position`` has copied the loaded values: they become the masters."""
        owned = self._modules[position][1]
        with torch.no_grad():  # the optimizer's own read of the values: not a use
            for index in owned:
                write_master(self.parts, self._slot(index))
        self._free(owned, keep_edits=False)

    def reset(self) -> None:
        """The masters were replaced (a resume, a loaded snapshot): free what holds values."""
        self._ahead.drop()
        self._release_loose()
        self._kept.clear()
        self._free(list(self._live), keep_edits=False)

    def stats(self) -> dict[str, Any]:
        """What streaming did: parameters streamed, the bytes of ``device_budget`` they may
        hold, bytes read from the store and copied from resident slices since the start, bytes
        held now and at most."""
        return {
            "streamed": len(self._streamed()),
            "budget": self._budget,
            "idle_room": self._idle_room,
            "idle_bytes": self._memory.idle,
            "kept_bytes": sum(self._bytes(i) for i in self._kept),
            "fetched_bytes": self.fetched_bytes,
            "copied_bytes": self.copied_bytes,
            "uploaded_ahead_bytes": self.uploaded_ahead_bytes,
            "kept_grad_bytes": self.gradients.kept_bytes,
            "live_bytes": self.live_bytes,
            "peak_bytes": self.peak_bytes,
        }

    # -- reading and freeing -----------------------------------------------------------------
    def _slot(self, index: int) -> Slot:
        return self.parts.layout.slots[index]

    def _bytes(self, index: int) -> int:
        """Bytes of slot ``index``'s parameter values, noted once (asking the parameter goes
        through its :class:`~tierswap.optim.stream._guard.StreamedParameter` guard)."""
        size = self._sizes.get(index)
        if size is None:
            size = self._sizes[index] = nbytes(self._slot(index).param)
        return size

    def _read_into(
        self,
        targets: dict[int, torch.Tensor],
        *,
        grad: bool = False,
        later: list[ToDevice] | None = None,
    ) -> None:
        """Fill each flat tensor of ``targets`` (slot index -> tensor) with that slot's
        master (or, with ``grad``, its kept gradient), counting the bytes (``later``: the
        copies, not waited for, as :func:`read_into` makes them)."""
        pipeline, layout = self.parts.backend.pipeline, self.parts.layout
        ahead = self._ahead.names
        copied, fetched = read_into(pipeline, layout, targets, ahead, grad=grad, later=later)
        self.copied_bytes += copied
        self.fetched_bytes += fetched

    def _room(self, coming: int = 0) -> int:
        """Bytes that parameters' memory idle between uses may take: what ``device_budget``
        leaves beside the parameters holding values (and ``coming`` bytes more about to), and
        the host budget's share for it (``idle_room``)."""
        return max(self._budget - self.live_bytes - coming, 0) + self._idle_room

    def _fetch(self, indices: list[int], *, later: list[ToDevice] | None = None) -> None:
        """Give the parameters of slots ``indices`` that hold no values their values (those
        kept between uses have them; those uploaded ahead are made ready), first freeing kept
        ones, those used latest first, as far as ``device_budget`` needs: it holds the
        parameters in use and the kept ones. ``later``: the copies of an upload ahead
        (:meth:`_upload_ahead`), not waited for."""
        self._ready_uploads(indices)
        self._kept.difference_update(indices)
        missing = [i for i in indices if i not in self._live]
        if not missing:
            return
        need = sum(self._bytes(i) for i in missing)
        while self._kept and self.live_bytes + need > self._budget:
            latest = max(self._kept, key=self._order.next_use)
            self._kept.discard(latest)
            self._free([latest])
        params = [self._slot(i).param for i in missing]
        try:
            flats = self._memory.allocate(params, room=self._room(need))
            self._read_into(dict(zip(missing, flats, strict=True)), later=later)
        except BaseException:
            for param in params:
                self._memory.free(param)
            self._memory.trim(self._room())
            raise
        self._live.update(missing)
        self._versions.update((i, self._slot(i).param._version) for i in missing)
        self.live_bytes += sum(self._bytes(i) for i in missing)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _let_go(self, indices: Iterable[int]) -> None:
        """The parameters of slots ``indices`` are not in use any more: keep those whose next
        use comes soonest within what ``device_budget`` leaves beside the parameters still in
        use (Belady on the recorded order, among them and those kept already; while the first
        iteration records it, those that fit), free the others."""
        self._ready_uploads(indices)  # idle from now on: kept or freed as any other
        idle = self._kept | set(indices)
        if not self._budget:
            self._free(idle)
            self._kept.clear()
            return
        busy = sum(self._bytes(i) for i in self._live - idle)  # still in use
        kept = self._order.keep_soonest(idle, self._budget - busy, self._bytes)
        self._free(idle - kept)
        self._kept = kept

    def _free(self, indices: Iterable[int], *, keep_edits: bool = True) -> None:
        """Free the parameters of slots ``indices`` that hold values, first keeping those
        written into since they were read (``keep_edits``: :meth:`_keep_edits`) and the
        masters steps left lagging their values (:func:`write_lagging_masters`); without
        ``keep_edits`` (the masters were replaced) both are dropped."""
        live = [i for i in indices if i in self._live]
        self._ready_uploads(live)  # their copies end before anything reads or frees them
        if keep_edits:
            self._keep_edits(live)
            write_lagging_masters(self.parts, live)
        for index in live:
            self.parts.state.unwritten_masters.pop(index, None)
            self._memory.free(self._slot(index).param)
            self._live.discard(index)
            self._versions.pop(index, None)
            self._edited.discard(index)
            self.live_bytes -= self._bytes(index)
        self._memory.trim(self._room())

    def edited(self, index: int) -> None:
        """An operation wrote into the values of slot ``index``'s parameter through an alias
        with a version counter of its own (``.data``; its
        :class:`~tierswap.optim.stream._guard.StreamedAlias` saw it)."""
        if index in self._live:
            self._edited.add(index)

    def _keep_edits(self, indices: list[int]) -> None:
        """Write the values of the live parameters of ``indices`` that were written into
        since they were read (an in-place op outside the optimizer: an init, a clamp, an
        average copied back; the parameter's ``_version`` moved, or :meth:`edited`) where
        their values are kept (:func:`keep_values`; reads of them started ahead are stale)."""
        self._ready_uploads(indices)  # an upload's own copy is no edit, nor read unfinished
        edited = [
            i
            for i in indices
            if i in self._edited or self._slot(i).param._version != self._versions.get(i)
        ]
        if not edited:
            return
        self._ahead.drop()
        pipeline, layout = self.parts.backend.pipeline, self.parts.layout
        with torch.no_grad():  # the optimizer's own read of the values: not a use
            for index in edited:
                slot = self._slot(index)
                keep_values(pipeline, layout, slot, slot.param.detach())
                self._versions[index] = slot.param._version
                self.parts.state.unwritten_masters.pop(index, None)  # all of it written
        self._edited.difference_update(edited)

    # -- the order of uses -------------------------------------------------------------------
    def _used(self, position: int) -> None:
        """Module ``position`` is used now: record it (first iteration), or find it in the
        recorded order and read the next modules' parameters ahead (:class:`ReadsAhead`)."""
        upcoming = self._order.used(position, PREFETCH_MODULES)
        self._ahead.start(
            dict.fromkeys(i for p in upcoming for i in self._modules[p][1] if i not in self._live)
        )
        if upcoming:
            self._upload_ahead(upcoming[0])

    def _upload_ahead(self, position: int) -> None:
        """On a GPU, start copying module ``position``'s parameters (used next) to the device
        before the kernels of the module in use are queued, so that the upload stream copies
        while those compute; the compute stream waits for them when the module is used
        (:meth:`_fetch`). Only when every value is in host memory (resident, or read ahead and
        landed): a wait for the disk here would hold back the module in use. One module at
        most (one the order skipped is freed); it may exceed ``device_budget``, as modules in
        use may."""
        indices = [i for i in self._modules[position][1] if i not in self._live]
        if not indices or not uploads_overlap(self._slot(indices[0]).param):
            return
        pipeline, layout = self.parts.backend.pipeline, self.parts.layout
        if not all(landed(pipeline, layout, self._slot(i)) for i in indices):
            return
        self._free(list(self._uploads))
        copies: list[ToDevice] = []
        try:
            self._fetch(indices, later=copies)
        except Exception:  # a hint: the module's own use reads them again (raising then)
            return
        self._uploads.update((i, copies) for i in indices)
        self.uploaded_ahead_bytes += sum(self._bytes(i) for i in indices)

    def _ready_uploads(self, indices: Iterable[int]) -> None:
        """Order the compute work queued from now on after the uploads ahead of ``indices``."""
        for index in indices:
            copies = self._uploads.pop(index, None)
            if copies:
                ready_all(copies)
                copies.clear()  # the module's other parameters share the list: done once
            if copies is not None:  # their copies have written them (a stand-in copies late)
                self._versions[index] = self._slot(index).param._version

    def read_values(self, index: int) -> torch.Tensor:
        """A CPU copy of slot ``index``'s parameter values (for a state dict of the model),
        read without giving the parameter memory."""
        return self._step.serve(functools.partial(self._read_values, index))

    def _read_values(self, index: int) -> torch.Tensor:
        param = self._slot(index).param
        if index in self._live:
            with torch.no_grad():  # the optimizer's own read of the values: not a use
                return param.detach().to("cpu", copy=True)
        out = torch.empty(param.shape, dtype=param.dtype)
        self._read_into({index: out.view(-1)})
        return out

    def names_of(self, model: torch.nn.Module) -> dict[str, int]:
        """Each name ``model.state_dict()`` gives a streamed parameter -> its slot index."""
        slot_of = self.parts.layout.slot_of
        return {
            name: slot_of[id(p)].index
            for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in slot_of and slot_of[id(p)].streamed
        }
