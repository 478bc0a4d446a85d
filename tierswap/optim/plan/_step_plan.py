"""The plan of one step: what every slice's work gets, fixed when the step starts.

Slices stepped in backward hooks and in ``step()`` share one plan, so they all see the state as
it was before the step (:meth:`tierswap.optim.persist.StepState.new_plan` makes it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepPlan"]


@dataclasses.dataclass
class StepPlan:
    """What one ``step()`` hands to the work of each slice.

    ``small_after`` is filled in: the scalar state (``step`` counters, ...) of each stepped slot.
    ``create`` makes a stored array for state that the step created (first step only), with
    its own chunk size where it does not take the store's.
    ``inners`` holds the torch optimizer that steps each param group (by group index).
    """

    inners: list[torch.optim.Optimizer]
    groups: list[dict[str, Any]]
    live: set[int]
    fresh: set[int]
    state_names: dict[int, list[str]]
    small_before: dict[int, dict[str, Any]]
    write_params: bool
    create: Callable[[str, tuple[int, ...], torch.dtype, int | None], None]
    chunk_bytes: int  # the store's chunk size, which slices cut parameters at
    small_after: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: Each live slot's gradient as ``step()`` saw it (a step that runs on after ``step()``
    #: returned); ``None``: read ``param.grad`` when the slice steps.
    grads: dict[int, torch.Tensor | None] | None = None
    #: Factors a gradient read from the swap space (a streamed parameter's, by slot) is
    #: multiplied by, in order, before it steps: what clipping does to gradients in memory.
    grad_scales: dict[int, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
