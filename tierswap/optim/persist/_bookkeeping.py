"""What a SwapOptimizer knows about its steps, beside the arrays in the store."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierswap.optim._config import SwapConfig
from tierswap.optim.plan import Slot, StepPlan
from tierswap.pipeline import Region

__all__ = ["StepState", "clone_state", "hyper_parameters", "same_values"]


@dataclasses.dataclass
class StepState:
    """The optimizer's step bookkeeping, owned by it and handed to the helpers that commit,
    restore, load and snapshot (:mod:`tierswap.optim.persist`).

    ``small`` holds each slot's scalar state (``step`` counters, ...) by slot index; ``names``
    the names of its per-element state tensors, which live in the store.
    """

    #: ``step()`` calls, counted across resumes.
    steps: int = 0
    small: defaultdict[int, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )
    names: defaultdict[int, list[str]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    #: Slices stepped in backward during this step (``overlap="backward"`` and ``"auto"``).
    stepped: set[int] = dataclasses.field(default_factory=set)
    #: The plan of a step under way (hooks and ``step()`` share it), else ``None``.
    plan: StepPlan | None = None
    #: A step raised halfway: the state is not a step's end, so it must not be committed.
    failed: bool = False
    #: Params without a master that the last step wrote to the store (with their slices).
    params_written: set[int] = dataclasses.field(default_factory=set)
    #: Master regions (by slot) whose stored values lag the values their streamed parameter
    #: holds: a schedule that never rolls back writes such a master only when a commit is
    #: due or the parameter lets its values go (:attr:`StepPlan.unwritten`).
    unwritten_masters: dict[int, set[Region]] = dataclasses.field(default_factory=dict)
    #: The state changed outside ``step()`` (a loaded state dict) since the last commit.
    changed: bool = False
    #: Factors each gradient kept in the swap space (by slot) is multiplied by before the
    #: next step reads it (clipping, with ``offload_parameters``), in order.
    grad_edits: dict[int, list[Any]] = dataclasses.field(default_factory=dict)

    def holds_state(self) -> bool:
        """Whether any slot has state (per-element or scalar)."""
        return any(self.names.values()) or any(self.small.values())

    def new_plan(
        self,
        slots: Sequence[Slot],
        *,
        inners: list[torch.optim.Optimizer],
        groups: list[dict[str, Any]],
        write_params: bool,
        create: Callable[[str, tuple[int, ...], torch.dtype, int | None], None],
        chunk_bytes: int,
    ) -> StepPlan:
        """The plan of the next step over ``slots``: what every slice's work gets (kept for
        the whole step, so slices stepped in hooks and in ``step()`` see the same state before
        the step). Slots without any state yet are *fresh*: torch creates theirs."""
        fresh = {s.index for s in slots if not (self.names.get(s.index) or self.small.get(s.index))}
        return StepPlan(
            inners=inners,
            groups=groups,
            live=set(),
            fresh=fresh,
            state_names=self.names,
            small_before=self.small,
            write_params=write_params,
            create=create,
            chunk_bytes=chunk_bytes,
            grad_edits={i: tuple(f) for i, f in self.grad_edits.items()},
        )

    def restore(
        self, small: dict[int, dict[str, Any]], names: dict[int, list[str]], steps: int
    ) -> None:
        """Take the scalar state, state names and step count of a commit."""
        self.small = defaultdict(dict, small)
        self.names = defaultdict(list, names)
        self.steps = steps
        self.stepped.clear()
        self.unwritten_masters.clear()  # the commit's masters replace the values held
        self.failed = False  # a whole state again


#: Not hyper-parameters: a group's parameters and their names, the optimizer class a group
#: names, and settings of this run (ZeroRedundancyOptimizer copies its constructor keywords,
#: swap_dir, host_budget, ..., into every param group). A class or a Path among them would make
#: the committed blob unloadable with ``torch.load(weights_only=True)``.
_NOT_HYPER = frozenset(
    ("params", "param_names", "optimizer_class", *(f.name for f in dataclasses.fields(SwapConfig)))
)


def hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    """What a commit stores of a param group: its hyper-parameters (also for comparisons)."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def same_values(a: Any, b: Any) -> bool:
    """Equality of nested dicts, lists and tensors (``==`` is ambiguous on tensors): how
    hyper-parameters are compared."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def clone_state(value: Any) -> Any:
    """A copy of a slot's scalar state (nested dicts of tensors and numbers), tensors cloned."""
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    return value.clone() if torch.is_tensor(value) else value
