"""The one object a SwapOptimizer builds and hands to the helpers that step, commit, resume,
load and snapshot: its parts."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierswap.optim._config import SwapConfig
    from tierswap.optim.persist._backend import StateBackend
    from tierswap.optim.persist._bookkeeping import StepState
    from tierswap.optim.persist._commit_clock import CommitClock
    from tierswap.optim.persist._swapped_state import SwappedState
    from tierswap.optim.plan import Layout

__all__ = ["OptimizerParts"]


@dataclasses.dataclass(eq=False)
class OptimizerParts:
    """What one :class:`~tierswap.SwapOptimizer` runs on, built once by it.

    The optimizer owns every part; the :class:`~tierswap.optim.step.Stepper` and the
    functions of :mod:`tierswap.optim.persist` take this object instead of the parts one by
    one. ``layout`` is replaced whole when it changes (a param group added, a resume with
    another chunking); ``inners`` and ``groups`` are the optimizer's own lists, which it
    extends when a param group is added; the other parts are set once.

    Not locked: the training thread uses the parts, and so does the optimizer's worker (the
    step that runs into the next forward with ``overlap="forward"``, the slices handed over in
    backward with ``overlap="backward"``), while everything else that touches them waits for
    the worker first (:meth:`~tierswap.optim.step.DeferredSteps.wait`).
    """

    #: The settings the optimizer was built with.
    config: SwapConfig
    #: The swap folder's store and the pipeline that streams it.
    backend: StateBackend
    #: The slots, their slices and where each resident slice stays.
    layout: Layout
    #: What the optimizer knows of its state beside the stored arrays.
    state: StepState
    #: When a step ends with a commit.
    commits: CommitClock
    #: The optimizer's ``state`` attribute: empty between calls; entries written into it
    #: directly move into the swap space before a commit or state dict.
    swapped_state: SwappedState
    #: The torch optimizer that steps each param group (by group index).
    inners: list[torch.optim.Optimizer]
    #: The optimizer's param groups.
    groups: list[dict[str, Any]]
    #: Where slices step: ``cuda`` for the device tier on a GPU, else the CPU.
    compute_device: torch.device
    #: The torch optimizer class's name, recorded in every commit.
    optimizer_name: str
