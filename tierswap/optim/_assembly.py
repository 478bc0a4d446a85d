"""How a :class:`~tierswap.SwapOptimizer` is put together: the meta model placed, the
param groups cut into slots and laid out as slices, the swap folder's store and pipeline
opened, and its last commit resumed or its arrays created (and the parameter stream started).

A base class of the optimizer, apart so that its module holds the public face: the
constructors, stepping and introspection. A construction that fails returns meta-built
parameters to the meta device, leaves the torch optimizer's state as it was, and closes the
store (removing a temporary folder).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from tierswap.engine import transfers_for
from tierswap.errors import ConfigError
from tierswap.optim import persist
from tierswap.optim._checkpoints import Checkpoints
from tierswap.optim._config import SwapConfig
from tierswap.optim.distributed import check_resumed_steps, world
from tierswap.optim.persist import CommitClock, OptimizerParts, StateBackend, StepState
from tierswap.optim.plan import (
    Layout,
    Slot,
    check_class,
    check_unique,
    group_slots,
    inner_for,
    plan_layout,
)
from tierswap.optim.step import (
    DeferredSteps,
    Stepper,
    hold_threshold,
    register_grad_hooks,
)
from tierswap.optim.stream import (
    ParameterStream,
    Placed,
    check_owned,
    idle_room,
    initialize,
    place_model,
    to_meta,
)
from tierswap.tiers import DEVICE, HOST

__all__ = ["Assembly"]


class Assembly(Checkpoints):
    """The construction of a :class:`~tierswap.SwapOptimizer` and the parts it builds."""

    _config: SwapConfig

    def grad_final(self, param: torch.Tensor) -> None:
        """What the gradient hooks call (the optimizer's)."""
        raise NotImplementedError

    def _build(
        self,
        make_inner: Callable[[], torch.optim.Optimizer],
        config: SwapConfig,
        model: torch.nn.Module | None,
    ) -> None:
        """Place ``model``'s meta parameters, then :meth:`_setup` around the torch optimizer
        ``make_inner`` makes; a failure returns those parameters to the meta device, so a
        corrected call starts again from the model as it came."""
        unborn = Placed([], [])
        if model is not None:
            unborn = place_model(model, offload=config.offload_parameters)
        try:
            self._setup(make_inner(), config, model, unborn)
        except BaseException:
            for param in unborn.params:
                to_meta(param)
            raise

    # -- construction ---------------------------------------------------------------------
    def _setup(
        self,
        inner: torch.optim.Optimizer,
        config: SwapConfig,
        model: torch.nn.Module | None = None,
        unborn: Placed | None = None,
    ) -> None:
        if config.offload_parameters and model is None:
            raise ConfigError(
                "offload_parameters=True needs the model, whose modules' hooks read the "
                "parameters: SwapOptimizer(model, torch.optim.AdamW, ..., "
                "offload_parameters=True), or, with param groups, model=model"
            )
        ranks = world()[1]
        if config.offload_parameters and ranks > 1:  # DDP reads the freed parameters
            raise ConfigError(
                f"offload_parameters=True under a process group of {ranks} ranks is not "
                "supported yet: DistributedDataParallel reads every parameter's memory (a "
                "freed one crashes the process) and reduces gradients the stream keeps in the "
                "swap folder; stream on one process, or swap the optimizer's state alone"
            )
        self._ready = False  # torch's constructor calls add_param_group before the rest exists
        #: What was built on the meta device: placed without values until ``_start``.
        self._unborn = unborn or Placed([], [])
        self._inner = inner
        # State the inner optimizer already holds (eager init as in Adagrad, or an optimizer
        # handed to offload()) moves into the swap space through load_state_dict below.
        existing = inner.state_dict() if inner.state else None
        self._config = config
        super().__init__(inner.param_groups, inner.defaults)
        step_state = StepState()
        self.state = persist.SwappedState(step_state)  # true when the swap space holds state
        self._requests = persist.Requests()  # armed by redirect_state_dict, hint_snapshot_folder
        self._inner_groups = inner.param_groups
        self._inners: list[torch.optim.Optimizer] = []  # the torch optimizer of each group
        #: Device bytes for optimizer state (the rest of ``device_budget`` holds the streamed
        #: parameters): set once, so that parameters and state never outgrow the budget.
        self._state_device = _state_device_bytes(config, self.param_groups)
        #: Host bytes that hold the memory streamed parameters leave idle between uses (on
        #: the CPU): the layout plans the rest of ``host_budget``.
        self._idle_room = _idle_room_bytes(config, self.param_groups, self._state_device)
        self.tier = DEVICE if self._state_device > 0 else HOST
        self.compute_device = _compute_device(self.tier)
        # Host <-> device copies of the slices (nothing moves on the CPU); tests put a
        # recording stand-in here to check the GPU path's ordering without a GPU.
        self._transfers = transfers_for(self.compute_device)
        slots: list[Slot] = []
        for group in self.param_groups:
            slots += self._new_slots(group, len(slots))
        check_unique([slot.prefix for slot in slots])
        if model is not None and config.offload_parameters:
            check_owned(model, slots)
        host = config.host_bytes
        layout = self._plan(slots, None if host is None else host - self._idle_room)
        if config.resume_from is not None and config.swap_dir is not None:
            persist.seed_swap_dir(config.swap_dir, config.resume_from)
        self._parts = OptimizerParts(
            config=config, backend=self._open_backend(layout), layout=layout, state=step_state,
            commits=CommitClock(_commit_every(config.commit_every)), swapped_state=self.state,
            inners=self._inners, groups=self.param_groups, compute_device=self.compute_device,
            optimizer_name=type(inner).__name__,
        )  # fmt: skip
        self._stepper = Stepper(self._parts)
        self._stream: ParameterStream | None = None  # offload_parameters: set once started
        self._start_or_close(config.resume, model)
        self._hook_handles = register_grad_hooks(self, [s.param for s in self._layout.slots])
        self._release_threshold: Callable[[], None] | None = None
        if model is not None and config.offload_parameters:
            self._start_stream(model)
        self._ready = True
        inner.state = defaultdict(dict)  # only now: a failed construction leaves it intact
        if existing is not None and not config.resume:
            self.load_state_dict(existing)

    def _start_stream(self, model: torch.nn.Module) -> None:
        """Stream ``model``'s parameters (``offload_parameters``) from now on."""
        slot_of = self._layout.slot_of
        meta_born = [slot_of[id(param)].index for param in self._unborn.params]
        budget = self._config.device_bytes - self._state_device
        into_forward = self._deferred if self._config.overlap == "forward" else None
        self._stream = ParameterStream(
            self._parts, model, meta_born, budget=budget, idle_room=self._idle_room,
            step=into_forward,
        )  # fmt: skip
        self._stream.start()
        # streamed parameters and gradients must leave memory when freed; released by
        # close(), or when the optimizer is garbage-collected without it
        self._release_threshold = hold_threshold()
        weakref.finalize(self, self._release_threshold).atexit = False

    def _open_backend(self, layout: Layout) -> StateBackend:
        """The swap folder's store and pipeline, sized by ``layout``."""
        config = self._config
        return StateBackend(
            config.swap_dir,
            budget=layout.host_budget,
            durable=config.durable,
            resume=config.resume,
            chunk_bytes=layout.chunk_bytes,
            device_budget=self._state_device,
            device=self.compute_device,
            transfers=self._transfers,
            work_on_device=self.tier == DEVICE,
        )

    def _start_or_close(self, resume: bool, model: torch.nn.Module | None) -> None:
        """:meth:`_start`, under the finalizer that closes the store: a failure closes it (and
        removes a temporary folder) before it propagates."""
        # Closes the store (and removes a temporary folder) when the optimizer is
        # garbage-collected without close(). Not at interpreter exit: the I/O pools are gone by
        # then; the at-exit closer of the backend handles that.
        self._finalizer: weakref.finalize[..., Assembly] = weakref.finalize(
            self, self._backend.close
        )
        self._finalizer.atexit = False
        try:
            self._start(resume, model)
            if resume:  # every rank must resume the same step (a collective)
                check_resumed_steps(self._state.steps, self._backend.path)
        except BaseException:
            self._finalizer()
            raise

    # The parts the methods below use most (also what tests look at).
    @property
    def _backend(self) -> StateBackend:
        return self._parts.backend

    @property
    def _state(self) -> StepState:
        return self._parts.state

    @property
    def _layout(self) -> Layout:
        """The slots, slices and placement the steps run over."""
        return self._parts.layout

    @property
    def _deferred(self) -> DeferredSteps:
        """The stepper's worker (``overlap="forward"`` and ``"backward"``)."""
        return self._stepper.deferred

    def _new_slots(self, group: dict[str, Any], first: int) -> list[Slot]:
        """The slots of ``group``'s parameters, numbered from ``first``; registers the torch
        optimizer that steps the group (checked: a class the library can slice or step whole)."""
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        optimizer_class = group.get("optimizer_class", type(self._inner))
        check_class(optimizer_class)
        slots = group_slots(
            group, group_index=group_index, first=first, optimizer_class=optimizer_class,
            config=self._config, compute_device=self.compute_device,
        )  # fmt: skip
        self._inners.append(inner_for(optimizer_class, self._inner, self._inners))
        return slots

    def _plan(
        self, slots: list[Slot], host_budget: int | None, chunk_bytes: int | None = None
    ) -> Layout:
        """The layout of ``slots`` under this optimizer's budgets and policy
        (:func:`~tierswap.optim.plan.plan_layout`)."""
        config = self._config
        return plan_layout(
            slots,
            host_budget=host_budget,
            device_budget=self._state_device,
            policy=config.policy,
            chunk_bytes=chunk_bytes,
            forward_order=config.overlap == "forward",
            device_compute=self._transfers.moves,
            in_backward=config.overlap == "backward",
        )

    def _start(self, resume: bool, model: torch.nn.Module | None) -> None:
        """Resume the folder's last commit, or create the arrays and write the masters (those
        of ``model``'s parameters built on the meta device: as its init gives them values)."""
        meta = self._backend.committed_meta() if resume else None
        init_fn = self._config.param_init_fn
        if meta is not None:
            self._restore(meta)
            if model is not None and self._unborn.buffer_owners:
                initialize(self._parts, model, self._unborn, init_fn, resumed=True)
            return
        slot_of = self._layout.slot_of
        unborn = [slot_of[id(param)] for param in self._unborn.params]
        persist.create_arrays(self._parts, self._layout.slots, unwritten=unborn)
        if model is not None and (unborn or self._unborn.buffer_owners):
            initialize(self._parts, model, self._unborn, init_fn)

    def _restore(self, meta: dict[str, Any]) -> None:
        """Load the commit ``meta`` describes; slices follow its chunking."""
        layout = self._layout
        # checked before anything changes: a refused resume leaves optimizer and folder alone
        saved_groups, small = persist.check_commit(self._parts, meta)
        chunk = meta.get("chunk_bytes")
        if chunk and chunk != layout.chunk_bytes:
            self._parts.layout = self._plan(layout.slots, layout.host_budget, chunk)
        if self._stream is not None:
            self._stream.reset()  # the masters change: parameters holding values are stale
        persist.restore_commit(self._parts, saved_groups=saved_groups, small=small)


def _commit_every(every: int | str) -> int | str:
    """``commit_every`` as the clock applies it: under ``torch.distributed`` every rank must
    commit the same steps (a resume checks it), and ``"auto"`` times each rank's own commits,
    so there it commits every step."""
    return 1 if every == "auto" and world()[1] > 1 else every


def _state_device_bytes(config: SwapConfig, groups: list[dict[str, Any]]) -> int:
    """The bytes of ``device_budget`` that hold optimizer state: all of it; with
    ``offload_parameters`` (the budget keeps the streamed parameters between uses), what the
    groups' parameters leave of it where the device tier is host memory (no GPU), so that
    resident state spares the disk what parameters do not use; on a GPU none (optimizer
    state beside streamed parameters in device memory is not built)."""
    if not config.offload_parameters:
        return config.device_bytes
    if not _device_tier_in_ram():
        return 0
    return max(config.device_bytes - sum(_value_bytes(groups)), 0)


def _idle_room_bytes(config: SwapConfig, groups: list[dict[str, Any]], state_device: int) -> int:
    """The bytes of ``host_budget`` that hold streamed parameters' memory idle between uses
    (:func:`~tierswap.optim.stream.idle_room`): with ``offload_parameters`` on a machine
    without a GPU (a GPU's caching allocator reuses device memory already) and a host budget;
    ``device_budget`` keeps what the state leaves of it."""
    host = config.host_bytes
    if not config.offload_parameters or host is None or not _device_tier_in_ram():
        return 0
    kept = config.device_bytes - state_device
    return idle_room(_value_bytes(groups), host_budget=host, kept=kept)


def _value_bytes(groups: list[dict[str, Any]]) -> list[int]:
    """The bytes of each parameter of ``groups`` (once, however many groups name it)."""
    params: dict[int, torch.Tensor] = {id(p): p for group in groups for p in group["params"]}
    return [p.numel() * p.element_size() for p in params.values()]


def _device_tier_in_ram() -> bool:
    """Whether the device tier is host memory: a machine without a GPU."""
    return not torch.cuda.is_available()


def _compute_device(tier: str) -> torch.device:
    if tier == DEVICE and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
