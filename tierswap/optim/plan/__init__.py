"""Planning: what the optimizer steps, in which pieces, and where each piece stays.

Owns the *slots* (one per parameter: its state's names and sizes, probed from the torch
optimizer class, its master and its keys in the store), the *slices* they are cut into (fixed
byte ranges of the flattened parameters, or whole matrices for Muon and Adafactor), the
*layout* (the slices in schedule order and the tier each resident one stays in, within the
budgets), and the *step plan* that one step hands to every slice's work. Nothing here touches
the store or runs a step.

- ``_probe``: what an optimizer class allows (cut, step whole, or refuse), and its state sizes;
- ``_names``: swap keys from parameter names;
- ``_partition``: :class:`Slot`, :class:`Segment`, :class:`Slice` and the cutting of slots;
- ``_slots``: the slots of a param group, and the torch optimizer that steps it;
- ``_layout``: :class:`Layout` and :func:`plan_layout` (slices and placement under budgets);
- ``_step_plan``: :class:`StepPlan`.
"""

from __future__ import annotations

from tierswap.optim.plan._layout import Layout, interleave, plan_layout
from tierswap.optim.plan._names import check_unique
from tierswap.optim.plan._partition import (
    Segment,
    Slice,
    Slot,
    array_chunk_bytes,
    check_first_steps,
    flat,
    local_tensor,
    master_dtype,
)
from tierswap.optim.plan._probe import check_class, own_defaults
from tierswap.optim.plan._slots import group_slots, inner_for
from tierswap.optim.plan._step_plan import GradClamp, StepPlan, apply_grad_edits

__all__ = [
    "GradClamp",
    "Layout",
    "Segment",
    "Slice",
    "Slot",
    "StepPlan",
    "apply_grad_edits",
    "array_chunk_bytes",
    "check_class",
    "check_first_steps",
    "check_unique",
    "flat",
    "group_slots",
    "inner_for",
    "interleave",
    "local_tensor",
    "master_dtype",
    "own_defaults",
    "plan_layout",
]
