"""SwapOptimizer: any torch optimizer with its state (and fp32 masters) on disk, streamed.

The optimizer the user names (``optimizer_class``) is instantiated once as the *inner*
optimizer. The flattened parameters are cut into fixed-size **slices** (a large parameter spans
several, small ones share one). Each ``step()`` runs the slices through the store's
:class:`~tierswap.pipeline.Pipeline`: the next slices' state is read while the current one steps
(torch's own kernel, on flat views) and the previous ones are written back, each byte read once
and written once. The slices the policy keeps resident (in the device tier, then in host
memory beside the pipeline's buffers) step spread among the streamed ones, so the disk keeps
working while they step. Per-element math is independent across elements, and a parameter whose
optimizer's math spans it (Muon, Adafactor) is never cut (both checked at construction), so
stepping in slices is bitwise equal to stepping all at once.

This class is the public face: the constructors, stepping and introspection; how the parts are
built is its base's (:mod:`~tierswap.optim._assembly`), commits, state dicts and snapshots are
that one's base's (:mod:`~tierswap.optim._checkpoints`). How a step runs its slices (in
``step()``, in backward hooks, or into the next forward) is
:class:`~tierswap.optim.step.Stepper`'s job.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch

from tierswap.engine import EvictionPolicy
from tierswap.errors import ConfigError
from tierswap.optim import persist
from tierswap.optim._assembly import Assembly
from tierswap.optim._config import SwapConfig
from tierswap.optim.formats import MasterFormat, StatePrecision
from tierswap.optim.plan import (
    Slice,
    check_class,
    check_first_steps,
    check_unique,
    own_defaults,
)
from tierswap.optim.step import (
    register_grad_hooks,
    remove_grad_hooks,
    step_allocations,
    trim_heap,
)
from tierswap.store import StorePaths
from tierswap.tiers import TierName

__all__ = ["SwapOptimizer"]


class SwapOptimizer(Assembly):
    """A ``torch.optim.Optimizer`` whose state lives on disk and streams through host memory.

    Parameters
    ----------
    params:
        Parameters or param groups, as for any torch optimizer, or the model itself (its
        ``named_parameters()``; ``offload_parameters`` needs it). A param group may name its
        own ``"optimizer_class"`` (e.g. ``torch.optim.Muon`` for hidden matrices beside
        AdamW); it takes its hyper-parameters from itself, then from that class's defaults.
    optimizer_class:
        The torch optimizer to run (``torch.optim.AdamW``, ``SGD``, ``Muon``, ``Adafactor``,
        ...). Per-element ones are stepped in slices that may cut parameters; those whose math
        spans a parameter (Muon, Adafactor) step whole parameters; one that mixes parameters
        raises ``ConfigError`` (all checked at construction).
    swap_dir:
        Folder of the swap store, or a list of folders, one per drive (chunk files spread
        over them; the first holds the store's metadata). ``None``: a temporary folder removed
        by :meth:`close`. Under ``torch.distributed`` each rank uses ``<folder>/rank-<r>``.
    host_budget, device_budget:
        Byte budgets of the host and device tiers (ints or strings such as ``"4GiB"``); the
        host budget holds every buffer of the step: resident slices and slices in flight.
        ``host_budget=None`` keeps all state in RAM; ``device_budget=0`` turns the device tier
        off. A budget below the smallest possible slice (one chunk of a parameter's state)
        raises ``ConfigError``.
    policy:
        ``"lookahead"`` (default) keeps a prefix of the slices resident, what Belady's rule
        does on the cyclic schedule of steps; ``"lru"`` (or an ``LRUPolicy``) streams every
        slice, as LRU does on a cycle larger than its memory.
    durable:
        Passed to the store: ``False`` writes in place, faster but not crash-safe.
    commit_every:
        When the swap folder commits atomically (a restart point). ``"auto"`` (default):
        whenever the time since the last commit reaches nine times what that commit cost, so
        commits take about a tenth of the training time whatever stays resident (under
        ``torch.distributed``, where all ranks must commit the same steps: every step). Where
        the forward leaves the CPU mostly idle (a GPU computes), such a commit ends behind its
        step: :meth:`step` returns once its writes have started, and the next use of the swap
        space (in the next backward, or a forward that reads parameters from it) waits for it;
        :meth:`synchronize` too. ``N``: every N steps, each done when its :meth:`step`
        returns; ``0``: only on :meth:`commit`. :meth:`close` commits the steps since the last
        commit.
    resume:
        Load master weights into the model params and restore state and step counts from the
        last commit in ``swap_dir``.
    resume_from:
        A snapshot (:meth:`snapshot`, or a trainer checkpoint's ``optimizer.tierswap`` folder)
        to resume from: ``swap_dir`` is replaced by hard links to it (a copy across
        filesystems), then the run resumes as with ``resume=True``. The snapshot is not changed.
    overlap:
        When the step runs. ``"auto"`` (default): each slice steps on the optimizer's worker
        during backward, as soon as the gradients of its parameters are final, without
        blocking autograd (*speculatively*); :meth:`step` checks those steps against the
        gradients and hyper-parameters it sees (after clipping, unscaling, edits), rolls the
        ones that differ back to their pre-step state and redoes them, steps the slices
        left, and returns with every parameter updated. Bitwise equal to the plain optimizer;
        where redoing recurs (clipping that triggers every step, ``GradScaler``) it stops
        speculating for a while (``tier_stats()["schedule"]``). Speculation needs a durable
        store and fp32 or bf16 state; where it cannot speculate (the first step, resident
        slices, ``"8bit"``, ``durable=False``) it steps as ``None`` does.
        ``"forward"``: the same, but :meth:`step` returns at once and the rest of the step
        (redoing included) runs while the next forward does, each module waiting only for its
        own parameters (read parameters otherwise after :meth:`synchronize`).
        ``None``: no overlap: the slices' reads start in backward, :meth:`step` steps them all.
        ``"backward"``: each slice steps on the hooks' worker (streamed parameters: in the
        hook) and nothing checks it: no global clipping, no ``GradScaler``.
        ``docs/optimizer.md`` says what each costs.
    accumulation_steps:
        Backward passes per optimizer step (gradient accumulation), for ``overlap="backward"``:
        a parameter's gradient is final at every ``accumulation_steps``-th backward pass.
    state_precision:
        How the moments (per-element fp32 state: AdamW's ``exp_avg``, ``exp_avg_sq``, ...)
        are stored, on disk and in every tier: ``"fp32"`` (default, exact), ``"bf16"`` or
        ``"8bit"`` (block-wise, as bitsandbytes and torchao; tensors under 4096 elements stay
        fp32). The step decodes a slice into fp32, runs torch's kernel, encodes back. Opt-in:
        it changes results (``docs/optimizer.md``, "Compact state"). Muon's momentum, of its
        matrix's size, is stored so too; Adafactor's factored statistics keep fp32, and so do
        optimizers with per-element state that is not a moment (ASGD's ``ax``, Rprop's
        ``prev``, ``step_size``).
    master:
        ``"fp32"`` (default) stores an fp32 master of each bf16 parameter; ``"remainder"``
        stores the parameter and a 16-bit remainder instead, which rebuild the fp32 master
        exactly (the parameter is then rounded half up, not half to even). Other parameters
        ignore it.
    offload_parameters:
        Stream the parameters too, for a model whose parameters do not fit (``params`` is the
        model, or param groups with ``model=``): between uses a parameter holds no memory (its
        shape, dtype and identity stay); each module's parameters are read from the swap space
        just before its forward and again when backward reaches it, and freed after; the step
        updates them there.
        Gradients go to the swap space as backward finalizes them (``param.grad`` holds a
        stand-in, on which torch's ``clip_grad_norm_`` works); ``device_budget`` then keeps
        the parameters used soonest between uses; on a machine without a GPU (where the
        device tier is RAM) the room all of them leave holds optimizer state, as without
        ``offload_parameters``.
        ``model.state_dict()`` reads them; :meth:`close` gives them back to the model (those
        built on the meta device go back to it, for a model too large for memory). Bitwise
        equal to the plain optimizer. With ``master="remainder"`` bf16 parameters stream at 2
        bytes an element. A param group added later streams too. With ``overlap="auto"``
        the slices step in backward, in the gradient hooks, with the gradients still in
        memory, and :meth:`step` checks them as above; with ``"backward"`` unchecked, and the
        gradients never go to the swap space (clipping them after backward raises).
        With ``"forward"`` what steps after backward runs on into the next forward, on the
        worker, which also runs the forward's reads of the parameters between its slices.
        ``docs/optimizer.md``, "Streaming parameters".
    param_init_fn:
        With ``offload_parameters``, for a model built on the meta device (too large to build
        in memory): the function of a module that gives its parameters their first values.
        It is called on every module, children first (as ``model.apply``); each parameter
        holds memory only during the calls that use it, and its first master goes straight
        to the swap space. ``None`` (default) calls ``reset_parameters()`` of each module that
        owns meta parameters (a model of torch's layers without tied weights starts from the
        values it has when built in memory from the same seed). For a Hugging Face model,
        ``model._init_weights``. A parameter no call gave a value raises ``ConfigError``. Meta
        parameters come to ``torch.get_default_device()``; meta buffers get zeroed memory
        there first.
    model:
        With ``offload_parameters`` and param groups in ``params`` (weight decay on some
        parameters only, Muon for the hidden matrices): the model whose modules' hooks stream
        them; every parameter in the groups must be one of its. ``params`` may be the model
        itself instead (one group).
    **optimizer_kwargs:
        Passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``, ``fused``, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        swap_dir: StorePaths | None = None,
        host_budget: int | str | None = None,
        device_budget: int | str = 0,
        policy: str | EvictionPolicy = "lookahead",
        durable: bool = True,
        commit_every: int | Literal["auto"] = "auto",
        resume: bool = False,
        overlap: str | None = "auto",
        accumulation_steps: int = 1,
        resume_from: str | os.PathLike[str] | None = None,
        state_precision: StatePrecision = "fp32",
        master: MasterFormat = "fp32",
        offload_parameters: bool = False,
        param_init_fn: Callable[[torch.nn.Module], None] | None = None,
        model: torch.nn.Module | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        config = SwapConfig(
            swap_dir=swap_dir, host_budget=host_budget, device_budget=device_budget,
            policy=policy, durable=durable, commit_every=commit_every, resume=resume,
            overlap=overlap, accumulation_steps=accumulation_steps, resume_from=resume_from,
            state_precision=state_precision, master=master,
            offload_parameters=offload_parameters, param_init_fn=param_init_fn, model=model,
        )  # fmt: skip
        check_class(optimizer_class)
        if isinstance(params, torch.nn.Module):
            if model is not None and model is not params:
                raise ConfigError("params is a model and model= names another one: pass one")
            model, params = params, params.named_parameters()
        self._build(
            lambda: optimizer_class(own_defaults(params), **optimizer_kwargs), config, model
        )

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **swap_kwargs: Any) -> SwapOptimizer:
        """A SwapOptimizer that takes over ``optimizer`` (what :func:`tierswap.offload` does).

        Keeps its class, param groups, hyper-parameters and any state it already holds; the
        state moves into the swap space, and ``optimizer`` must not be stepped again.
        ``swap_kwargs`` are the keywords of the constructor (``swap_dir``, ``host_budget``,
        ...). Raises ``ConfigError`` (also a ``TypeError``) for anything but a torch optimizer
        that is not already a SwapOptimizer, and for any other class the constructor refuses.
        """
        if isinstance(optimizer, SwapOptimizer):
            raise ConfigError("the optimizer is already a SwapOptimizer; use it as it is")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"offload() needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        check_class(type(optimizer))
        config = SwapConfig.from_keywords(**swap_kwargs)
        swap = cls.__new__(cls)  # the alternate constructor: the inner optimizer exists
        swap._build(lambda: optimizer, config, config.model)
        return swap

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch does); its state is swapped like the others."""
        if not self._ready:  # torch's constructor: the groups become slots in _setup
            super().add_param_group(param_group)
            return
        self._settle()
        if self._config.resume and self._state.steps:
            raise ConfigError("add_param_group after resuming a run is not supported")
        super().add_param_group(param_group)
        layout = self._layout
        try:
            added = self._new_slots(self.param_groups[-1], len(layout.slots))
            if self._stream is not None:  # its modules' hooks are what read a streamed one
                self._stream.check_owned(added)
            check_unique([slot.prefix for slot in layout.slots + added])
            new_layout = self._plan(layout.slots + added, layout.host_budget, layout.chunk_bytes)
            if self.compute_device.type == "cpu":  # (else work tensors count in each job)
                fresh = {slot.index for slot in added}
                check_first_steps(new_layout.slices, fresh, new_layout.host_budget, "host_budget")
        except BaseException:  # (the new group does not fit the budget): leave things as they were
            del self._inners[len(self.param_groups) - 1 :]
            self.param_groups.pop()
            raise
        self._backend.pipeline.evict()
        self._parts.layout = new_layout
        persist.create_arrays(self._parts, added)
        if self._stream is not None:  # the store holds their values now
            self._stream.adopt(added)
        remove_grad_hooks(self._hook_handles)
        self._hook_handles = register_grad_hooks(self, [s.param for s in self._layout.slots])

    # -- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every parameter that has a gradient, slice by slice; commit when due.

        With ``overlap="forward"`` the slices left are handed to a worker and this returns at
        once; they step, in forward order, while the next forward pass runs.
        """
        if self._stream is not None:
            self._stream.step_begins()
            trim_heap()  # forward and backward are over: what they freed leaves the heap
        self._stepper.end_speculation()
        self._adopt_direct_state()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._stepper.end_speculation()  # the slices its backward handed over
        if self._config.overlap in ("auto", "forward"):
            self._stepper.step_checked()
            return loss
        with step_allocations():  # the step's transients go back to the OS when freed
            self._stepper.step_now()
        if self._stream is not None and self._stream.keeps_all():  # forward reads nothing
            self._stepper.read_ahead_backward()
        return loss

    def grad_final(self, param: torch.Tensor) -> None:
        """Called by the post-accumulate-grad hook of ``param``: its gradient is final. Starts
        the reads of its slices, or with ``overlap="backward"`` steps the ones now ready
        (:meth:`~tierswap.optim.step.Stepper.grad_final`). With ``offload_parameters`` the
        gradient first goes to the swap space (:meth:`~tierswap.optim.stream.ParameterStream.
        grad_final`)."""
        if self._stream is None:
            self._stepper.grad_final(param)
            return
        stream, freed = self._stream, False
        grad = stream.grad_final(param, keep=self._stepper.keeps_grad(param))

        def done() -> None:  # after the slices that step now took their masters from it
            nonlocal freed
            if not freed:
                freed = True
                stream.grad_done(param)

        try:
            self._stepper.grad_final(param, grad, done=done)
        finally:
            done()

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of the optimizer; returns
        the total norm. With ``offload_parameters`` torch's function works on the stand-ins in
        ``param.grad`` (:class:`~tierswap.optim.stream.OffloadedGradient`): each answers its
        gradient's norm from the swap space and records the factor, which the step applies as
        it reads the gradient; bitwise what it does to gradients in memory."""
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )

    def synchronize(self) -> None:
        """Wait until the last step is done, its writes and commit included (the step returns
        while its last slices are still being written, or, with ``overlap="forward"``, before
        they step; a commit of ``commit_every="auto"`` may end behind it); raise a failure of
        it."""
        self._settle()
        persist.drain_writes(self._parts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's. A step still running keeps the gradients it was given: ``None`` here
        only drops the parameters' references; zeroing in place waits for the step first.
        Slices stepped speculatively in backward for a step that was not taken (a
        ``GradScaler`` skipped it) are rolled back first."""
        if not set_to_none:
            self._settle()
        self._stepper.gradients_dropped()
        self._state.grad_edits.clear()
        if self._stream is not None:  # kept gradients are dropped, never zeroed in place
            for slot in self._layout.slots:
                if slot.keeps_grad:
                    slot.param.grad = None
        super().zero_grad(set_to_none)

    def _settle(self) -> None:
        """Wait for the worker and a commit behind it; roll back slices speculated for a step
        not taken."""
        self._stepper.abandon()
        self._backend.pipeline.settle()

    # -- introspection and teardown -------------------------------------------------------
    @property
    def swap_dir(self) -> Path:
        """The folder of the swap store."""
        return self._backend.path

    @property
    def steps(self) -> int:
        """Number of ``step()`` calls, counted across resumes."""
        return self._state.steps

    @property
    def host_budget(self) -> int:
        """Bytes of the host tier: resident slices and slices in flight (with
        ``offload_parameters`` on the CPU, what ``host_budget`` leaves beside the share that
        holds the memory freed parameters leave idle)."""
        return self._layout.host_budget

    @property
    def slices(self) -> list[Slice]:
        """The slices in schedule order."""
        return list(self._layout.slices)

    partitions = slices  # the name of the unit before slices split parameters

    @property
    def placement(self) -> dict[int, TierName]:
        """Where each resident slice stays between steps: slice index -> ``"device"`` or
        ``"host"``, as the policy chose; slices not listed stream from disk every step."""
        return dict(self._layout.placement)

    def tier_stats(self) -> dict[str, Any]:
        """What each tier really holds and serves: ``{"device"|"host": {used, budget, hits,
        misses, bytes_in, bytes_out}, "nvme": {bytes_read, bytes_written, ...},
        "stall_seconds"}``. A hit is a slice stepped where it stayed resident (device or host
        tier), a miss a slice read from disk. ``"schedule"``: what the step's schedule did
        (``overlap``, and with ``"auto"`` or ``"forward"`` whether it speculates, and the slices
        stepped in backward, redone and stepped after backward;
        :class:`~tierswap.optim.step.Speculation`).
        ``"parameters"``, with ``offload_parameters``: parameters streamed, the bytes of
        ``device_budget`` they may hold (``"budget"``: the rest is the device tier's), bytes kept
        between uses, read and copied, gradient bytes kept, bytes holding values now and at
        most."""
        stats = self._backend.stats()
        stats["schedule"] = {"overlap": self._config.overlap}
        if self._stepper.speculative:
            stats["schedule"].update(self._stepper.speculation.stats(self._state.steps))
        if self._stream is not None:
            stats["parameters"] = self._stream.stats()
        return stats

    def close(self) -> None:
        """Commit the steps taken since the last commit, then release hooks, pipeline and store.

        The final commit happens only where a resume can use it: a durable store in a
        ``swap_dir`` of yours (not a temporary folder, not ``durable=False``), after complete
        steps. After a failed step, or when the commit fails, it warns (``RuntimeWarning``)
        and the folder keeps its last commit. A temporary swap folder is removed.
        """
        remove_grad_hooks(self._hook_handles)
        self._hook_handles = []
        failure: BaseException | None = None
        try:
            self._settle()  # a step still running finishes first; one not taken rolls back
        except BaseException as exc:
            failure = exc
        try:
            self._deferred.close()
        except BaseException as exc:  # it failed: no final commit (it warns), then raise it
            failure = failure or exc
        try:
            with torch.no_grad():  # as a step's commits: values are read, not recorded
                persist.final_commit(self._parts)
        finally:  # the lock and the store are released even when the commit fails
            try:
                if self._stream is not None:  # the model gets its parameters' values back
                    self._stream.close()
            finally:
                if self._release_threshold is not None:
                    self._release_threshold()
                self._finalizer()
        if failure is not None:
            raise failure

    def __enter__(self) -> SwapOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SwapOptimizer({type(self._inner).__name__}, params={len(self._layout.slots)}, "
            f"slices={len(self._layout.slices)}, tier={self.tier!r}, "
            f"host_budget={self.host_budget}, swap_dir={str(self._backend.path)!r})"
        )
