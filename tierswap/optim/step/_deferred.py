"""The optimizer's worker thread: the step that runs into the next forward pass
(``overlap="forward"``), and the slices that step during backward (``overlap="backward"``).

``step()`` sees what only it can see (clipped gradients, a ``GradScaler``'s verdict, the LR
scheduler's values), hands the slices to a worker thread, and returns. The worker streams the
slices in *forward* order while the next forward pass runs; a forward pre-hook on every module
waits only until that module's own parameters are updated. Anything that reads parameters or
state in between (``state_dict()``, ``snapshot()``, ``commit()``, ``synchronize()``, the next
``step()``, ``close()``) waits for the whole step first. An iteration then costs about
max(compute, disk) instead of their sum. With ``overlap="backward"`` each gradient hook queues
the slices its gradient makes ready (:meth:`DeferredSteps.queue`) and returns, so autograd goes
on (on a GPU the thread that launches the backward kernels never waits for the disk or the
step); ``step()`` waits for them.

Concurrency: :class:`DeferredSteps` runs one step at a time on its own thread; ``start``,
``wait`` and ``close`` are called from the training thread, ``queue`` from the gradient hooks,
``done`` from the worker, and ``wait_for`` from any thread running a forward pass. One
condition variable guards the pending counts and the queue; a failed step is raised once, by
the next ``wait`` (or ``wait_for``).

With streamed parameters the step that runs into the forward *serves* it: the pipeline is used
by one thread at a time, and the forward's hooks read their modules' parameters through it.
While such a step runs, :meth:`DeferredSteps.serve` hands the hook's work to the worker, which
runs it between two slices (:meth:`DeferredSteps.between`), and the calling thread waits for
it; once the step has ended (its last calls served) the hooks run on their own thread again.
That step runs on a thread of its own, at the priority of the training thread (the others run
:data:`NICENESS` levels below it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

__all__ = ["DeferredSteps", "frozen_group", "own_parameters"]

T = TypeVar("T")


def frozen_group(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param group as it is now, for a step that runs on after ``step()``
    returned: an LR scheduler that moves on (or edits a tensor ``lr`` in place) does not
    reach it."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()}


#: How much nicer than the thread that made it the worker runs: a model computed on the CPU
#: keeps its cores in backward and forward, and the worker gets the CPU that a GPU's wait
#: leaves idle.
NICENESS = 10


def _yield_cpu() -> None:
    """On the worker's thread (Linux): lower its CPU priority by :data:`NICENESS` (to 19 at
    most); torch's OpenMP threads that it starts inherit it. Elsewhere, nothing changes."""
    with contextlib.suppress(AttributeError, OSError):
        me = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, me)
        os.setpriority(os.PRIO_PROCESS, me, min(19, nice + NICENESS))


def _settle(future: Future[T], call: Callable[[], T]) -> None:
    """Run ``call`` and put its result, or its failure, in ``future``."""
    try:
        result = call()
    except BaseException as error:  # the caller's to raise
        future.set_exception(error)
    else:
        future.set_result(result)


def own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a module's forward reads before its submodules' hooks run: its own, or
    for a ``torch.compile`` wrapper (whose submodules' hooks do not run eagerly) all of those
    under it."""
    compiled = getattr(module, "_orig_mod", None) is not None
    return list(module.parameters(recurse=compiled))


class DeferredSteps:
    """A worker thread for steps, and the parameters whose update is still pending."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: dict[int, int] = {}  # id(param) -> slices of this step still to run
        self._future: Future[None] | None = None
        self._queued: list[Future[None]] = []  # slices handed over by backward hooks
        self._failed = False
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tierswap-step", initializer=_yield_cpu
        )
        #: The thread of a step that serves the forward (:meth:`serve`): at the priority of
        #: the thread that made it, since the forward waits for it module by module (a nicer
        #: worker would get the CPU only while the forward waits: the two would take turns).
        self._serving_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierswap-serve")
        self._hook: Any = None
        self._guarded: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        #: A step that serves calls runs on the worker (:meth:`serve`), and the calls waiting.
        self._serving = False
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._worker: int | None = None  # the worker's thread ident, once it ran
        self._each_slice: weakref.WeakMethod[Callable[[], None]] | None = None

    @property
    def busy(self) -> bool:
        """A step is scheduled or running."""
        future = self._future
        return future is not None and not future.done()

    def queue(self, run: Callable[[], None]) -> None:
        """Run ``run`` on the worker after what was queued before it, and return at once (a
        backward hook's slices: autograd goes on while they step). :meth:`wait` waits for it
        and raises its failure once."""
        future = self._pool.submit(run)
        with self._cv:
            self._queued.append(future)

    def cancel_queued(self) -> None:
        """Drop the queued work that has not started (``step()`` knows the final gradients
        now: those slices step with the rest)."""
        with self._cv:
            self._queued = [future for future in self._queued if not future.cancel()]

    def start(
        self, counts: Mapping[int, int], run: Callable[[], None], *, serves: bool = False
    ) -> None:
        """Run ``run`` on the worker; ``counts`` says how many slices hold each parameter
        (by ``id``) that the step updates. Waits for the previous step first. ``serves``:
        ``run`` calls :meth:`between` between its slices, and :meth:`serve` hands it the
        calls of other threads until it ends."""
        self.wait()
        with self._cv:
            self._pending = dict(counts)
            self._failed = False
            self._serving = serves
        pool = self._serving_pool if serves else self._pool
        self._future = pool.submit(self._run, run)

    def _run(self, run: Callable[[], None]) -> None:
        self._worker = threading.get_ident()
        try:
            run()
        except BaseException:
            with self._cv:
                self._failed = True
            raise
        finally:
            with self._cv:
                self._pending.clear()
                self._cv.notify_all()
            self._serve_last()

    def serve(self, call: Callable[[], T]) -> T:
        """``call()`` where the pipeline is used now: on the worker between two slices, while
        a step that serves calls runs there (this thread waits for it, and gets its result or
        failure), else here."""
        if threading.get_ident() != self._worker:
            future: Future[T] | None = None
            with self._cv:
                if self._serving:
                    future = Future()
                    self._calls.append((call, future))
            if future is not None:
                return future.result()
        return call()

    def between(self) -> None:
        """On the worker, between two slices of a step that serves calls: run the calls
        waiting, in order."""
        for call, future in self._take_calls():
            _settle(future, call)
        each = self._each_slice() if self._each_slice is not None else None
        if each is not None:
            each()

    def after_each_slice(self, call: weakref.WeakMethod[Callable[[], None]]) -> None:
        """Have a step that serves calls call ``call`` (held weakly) between its slices, after
        the calls waiting (the stream reads ahead what the slices just stepped)."""
        self._each_slice = call

    def _serve_last(self) -> None:
        """The step ended: serve the calls that came meanwhile, then none more (they run on
        their own threads from now on)."""
        while calls := self._take_calls(last=True):
            for call, future in calls:
                _settle(future, call)

    def _take_calls(self, *, last: bool = False) -> list[tuple[Callable[[], Any], Future[Any]]]:
        """The calls waiting, taken off the queue; with ``last``, when none waits, the step
        serves none more (under the lock, so that none is left queued)."""
        with self._cv:
            calls, self._calls = self._calls, []
            if last and not calls:
                self._serving = False
            return calls

    def pending(self, param: torch.Tensor) -> bool:
        """Whether the step under way has still to update (part of) ``param``."""
        return id(param) in self._pending

    def done(self, params: Iterable[torch.Tensor]) -> None:
        """The worker finished a slice that updated (parts of) ``params``."""
        with self._cv:
            for param in params:
                left = self._pending.get(id(param), 0) - 1
                if left > 0:
                    self._pending[id(param)] = left
                else:
                    self._pending.pop(id(param), None)
            self._cv.notify_all()

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Block until every one of ``params`` is updated (a module about to run forward; on
        the worker, which updates them, nothing waits)."""
        if not self._pending or threading.get_ident() == self._worker:  # (no lock taken)
            return
        ids = {id(p) for p in params}
        with self._cv:
            while ids & self._pending.keys() and not self._failed:
                self._cv.wait()
        if self._failed:
            self.wait()  # raises the step's failure

    def wait(self) -> None:
        """Block until the step in flight and the queued slices (if any) have finished; raise
        the first failure once."""
        with self._cv:
            queued, self._queued = self._queued, []
        future, self._future = self._future, None
        errors = [f.exception() for f in [*queued, *([future] if future else [])]]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first

    def hook_modules(
        self, first: weakref.WeakMethod[Callable[[torch.nn.Module], None]], *, wait: bool
    ) -> None:
        """Install the global forward pre-hook that calls ``first(module)`` (the optimizer's
        check that no speculative step changed the module's parameters) and, with ``wait``
        (a step that runs into the next forward), waits for the module's own parameters
        (:func:`own_parameters`); each module it sees then also gets a ``state_dict``
        pre-hook that waits so (a checkpoint saved right after ``step()`` holds the stepped
        parameters). Both hold this object weakly: a dropped optimizer leaves no work in
        forward. Inside a ``torch.compile`` trace the hook does nothing (it cannot wait
        there); the compiled module's own call, which runs eagerly, does it for all the
        parameters under it."""
        ref = weakref.ref(self)

        def own_params_ready(module: torch.nn.Module, *_: Any) -> None:
            steps = ref()
            if steps is not None and steps._pending:
                steps.wait_for(own_parameters(module))

        def before_forward(module: torch.nn.Module, _args: Any) -> None:
            if torch.compiler.is_compiling():
                return
            call = first()
            if call is not None:
                call(module)
            steps = ref()
            if not wait or steps is None:
                return
            if module not in steps._guarded:  # its state_dict() waits for its parameters too
                steps._guarded.add(module)
                module.register_state_dict_pre_hook(own_params_ready)  # type: ignore[no-untyped-call]
            own_params_ready(module)

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

    def close(self) -> None:
        """Wait for the step in flight, remove the hook, stop the worker."""
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._pool.shutdown(wait=True)
            self._serving_pool.shutdown(wait=True)
