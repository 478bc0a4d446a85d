"""The plan of one step: what every slice's work gets, fixed when the step starts.

Slices stepped in backward hooks and in ``step()`` share one plan, so they all see the state as
it was before the step (:meth:`tierswap.optim.persist.StepState.new_plan` makes it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tierswap.pipeline import Region

__all__ = ["GradClamp", "StepPlan", "apply_grad_edits"]


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
    #: What a gradient read from the swap space (a streamed parameter's, by slot) gets, in
    #: order, before it steps (:func:`apply_grad_edits`): what clipping and unscaling did to
    #: the gradients in memory.
    grad_edits: dict[int, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    #: A streamed parameter's gradient still in memory (by slot), for a slice that steps in
    #: backward as its gradients become final: it steps with it instead of the one it keeps
    #: in the swap space, and reads only its state.
    held: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: Under a schedule that never rolls back (``overlap=None`` or ``"backward"``): the
    #: master regions, by slot, whose parameter holds the values (the step filled them from
    #: it, :func:`~tierswap.optim.step.valued_masters`) and that the step did not write, as no
    #: commit is due (:attr:`~tierswap.optim.persist.StepState.unwritten_masters`, shared).
    #: ``None``: every master is written with its slice (a speculative step's rollback
    #: restores the parameters from the stored masters).
    unwritten: dict[int, set[Region]] | None = None


@dataclasses.dataclass(frozen=True)
class GradClamp:
    """A clamp of a gradient into ``[low, high]`` in place (a bound may be ``None``): what
    ``torch.nn.utils.clip_grad_value_`` does to each gradient."""

    low: Any = None
    high: Any = None


def apply_grad_edits(grad: torch.Tensor, edits: tuple[Any, ...] | list[Any]) -> torch.Tensor:
    """Apply ``edits`` to ``grad`` in place, in order, with the operations torch applied to
    a gradient in memory: a number or one-element tensor multiplies it (clipping by norm, a
    ``GradScaler``'s unscale), a :class:`GradClamp` clamps it (clipping by value)."""
    for edit in edits:
        if isinstance(edit, GradClamp):
            low, high = (_on(bound, grad.device) for bound in (edit.low, edit.high))
            grad.clamp_(min=low, max=high)
        else:
            grad.mul_(_on(edit, grad.device))
    return grad


def _on(value: Any, device: torch.device) -> Any:
    """``value`` on ``device`` when it is a tensor (``to`` is an op, called only when it
    moves: each op lets the GIL go, and a step edits every gradient it reads back)."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value
