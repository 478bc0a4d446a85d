"""Stepping: how a step runs its slices, and when (in ``step()``, in backward, into forward).

Owns the :class:`Stepper` (a step's slices as pipeline jobs, stepped now, in backward hooks or
on a worker while the next forward runs), the work of one slice (torch's own kernel on flat
views of the slice's state, decoding and encoding compact state), the worker of deferred
steps, the gradient hooks that tell the optimizer a parameter's gradient is final, and the C
allocator's settings while a step runs.

- ``_stepper``: :class:`Stepper`, when a step's slices run;
- ``_runner``: :class:`~tierswap.optim.step._runner.SliceRunner`, how they run through the
  pipeline (their jobs, reads ahead, the plan, each slice's work);
- ``_slice_job``: what one slice's step reads and holds (its pipeline job);
- ``_slice_work``: one slice's work, as the pipeline calls it;
- ``_deferred``: the worker of ``overlap="forward"``, ``"auto"`` and ``"backward"``
  (:class:`DeferredSteps`);
- ``_speculation``: what ``overlap="auto"`` checks of the slices it stepped in backward
  (:class:`~tierswap.optim.step._speculation.Speculation`), and where it cannot speculate;
- ``_held``: the gradients that streamed parameters' slices step with in backward, and the
  reads of the next slices' state started ahead;
- ``_hooks``: the post-accumulate-grad hooks;
- ``_memory``: the allocator around a step (:func:`step_allocations`).
"""

from __future__ import annotations

from tierswap.optim.step._deferred import DeferredSteps
from tierswap.optim.step._hooks import register as register_grad_hooks
from tierswap.optim.step._hooks import remove as remove_grad_hooks
from tierswap.optim.step._memory import hold_threshold, step_allocations, trim_heap
from tierswap.optim.step._stepper import Stepper

__all__ = [
    "DeferredSteps",
    "Stepper",
    "hold_threshold",
    "register_grad_hooks",
    "remove_grad_hooks",
    "step_allocations",
    "trim_heap",
]
