"""Speculation: slices stepped during backward, checked by ``step()``, redone when wrong.

With ``overlap="auto"`` a slice whose gradients are final steps on the
optimizer's worker while backward goes on, before ``step()`` is called: before anything
(global-norm clipping, a ``GradScaler``, a hand-made edit, an LR change) could change what the
step should use. So each speculative step keeps what it used:

- a *stamp* of each gradient segment it read: a 128-bit hash (xxh3) of its bytes, about 24
  GB/s on one core. ``step()`` counts a segment unchanged when the gradient's bytes hash the
  same: torch's ``clip_grad_norm_`` multiplies in place by exactly 1.0 when it does not clip,
  which changes no byte. A tensor's ``_version`` counter is no shortcut: ``GradScaler``'s
  unscaling kernel and edits through ``.data`` change the bytes without moving it;
- the hyper-parameters of the param groups it stepped with.

A streamed parameter's gradient (``offload_parameters``) leaves memory once its slices stepped:
``param.grad`` holds its :class:`~tierswap.optim.stream.OffloadedGradient` stand-in, on which
clipping and unscaling only record factors. Its stamp is that stand-in: the step holds when
``param.grad`` is still it (no later backward pass replaced it) and every factor recorded
since is exactly 1 (clipping that did not clip), which changes no byte either.

The store keeps the pre-step state (a savepoint, :meth:`tierswap.SwapStore.savepoint`), and the
slice wrote the pre-step value of each parameter the store keeps (``persists_param``) beside
it, so a slice found wrong returns to its pre-step state and steps again with what ``step()``
sees. When slices are redone in two steps running, the optimizer stops speculating for a
while (8 steps, doubling each time it fails again, up to 256) and steps after backward instead;
:meth:`Speculation.stats` says what it did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from tierswap.optim.distributed import world
from tierswap.optim.persist import same_values
from tierswap.optim.plan import Slice, Slot, StepPlan, local_tensor

__all__ = ["Speculation", "Stamp", "reduced_after_backward", "same_groups", "stamps_of"]

#: Steps without speculation after slices were redone in two steps running, at first.
FIRST_PAUSE = 8
#: The longest pause.
LONGEST_PAUSE = 256


@dataclasses.dataclass(frozen=True)
class Stamp:
    """One gradient segment as a speculative step read it: elements ``[start, stop)`` of
    slot ``slot``'s gradient, their dtype and the hash of their bytes."""

    slot: int
    start: int
    stop: int
    dtype: torch.dtype
    digest: int
    #: A streamed gradient's stand-in (``param.grad`` once its bytes left memory), else None.
    stand_in: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, slot: int, grad: torch.Tensor, start: int, stop: int) -> Stamp:
        return cls(slot, start, stop, grad.dtype, _digest(grad, start, stop))

    @classmethod
    def kept(cls, slot: int, stand_in: Any, grad: torch.Tensor, start: int, stop: int) -> Stamp:
        """The stamp of a streamed gradient ``grad``, whose ``param.grad`` is ``stand_in``."""
        return cls(slot, start, stop, grad.dtype, 0, stand_in)

    def holds(self, grad: torch.Tensor | None, edits: Sequence[Any] = ()) -> bool:
        """Whether ``grad`` (the parameter's gradient now, with the ``edits`` recorded for
        a streamed one) still has this segment's bytes."""
        if self.stand_in is not None:
            return grad is self.stand_in and all(_neutral(edit) for edit in edits)
        if grad is None or grad.dtype != self.dtype:
            return False
        return _digest(grad, self.start, self.stop) == self.digest


def _digest(grad: torch.Tensor, start: int, stop: int) -> int:
    segment = local_tensor(grad).reshape(-1)[start:stop]
    data = segment.detach().to("cpu").contiguous().view(torch.uint8)
    return int(xxhash.xxh3_128_intdigest(data.numpy().data))


def _neutral(edit: Any) -> bool:
    """Whether a recorded edit of a kept gradient changes none of its bytes: a factor of
    exactly 1 (a clamp may change them)."""
    if isinstance(edit, torch.Tensor):
        return edit.numel() == 1 and bool(edit.detach().to("cpu", torch.float64).item() == 1.0)
    return isinstance(edit, int | float) and edit == 1.0


def stamps_of(plan: StepPlan, piece: Slice) -> list[Stamp]:
    """What a speculative step of ``piece`` with ``plan`` reads of each live gradient (a
    streamed one held in memory: its stand-in in ``param.grad``)."""
    found = []
    for seg in piece.segments:
        index, grad = seg.slot.index, seg.slot.param.grad
        if index not in plan.live or grad is None:
            continue
        held = plan.held.get(index)
        if held is not None:
            found.append(Stamp.kept(index, grad, held, seg.start, seg.stop))
        else:
            found.append(Stamp.of(index, grad, seg.start, seg.stop))
    return found


def reduced_after_backward(slots: list[Slot]) -> bool:
    """Whether the gradients are averaged across ranks only when backward ends: plain tensors
    under a process group of several ranks (DDP, alone or under ZeRO). Their hooks fire on each
    rank's local gradient, so a slice stepped in backward would always be redone. FSDP2's
    sharded parameters (DTensors) get their hooks after the reduce-scatter: final."""
    return world()[1] > 1 and not any(local_tensor(s.param) is not s.param for s in slots)


def same_groups(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> list[bool]:
    """Per group: whether ``a``'s and ``b``'s hyper-parameters are equal (tensors by value)."""
    return [same_values(x, y) for x, y in zip(a, b, strict=False)] + [False] * abs(len(a) - len(b))


class Speculation:
    """The speculative slices of the step under way, and the record of the schedule.

    Used by the :class:`~tierswap.optim.step.Stepper`: :meth:`record` from the worker (a slice
    stepped), the rest from the training thread once the worker is idle."""

    def __init__(self, enabled: bool) -> None:
        #: Whether this optimizer speculates at all (a durable store, state it can roll back).
        self.enabled = enabled
        #: Slice index -> the stamps of its speculative step.
        self.stamps: dict[int, list[Stamp]] = {}
        #: The hyper-parameters of the param groups the speculative slices stepped with.
        self.groups: list[dict[str, Any]] | None = None
        self._streak = 0  # steps in a row that redid slices
        self._pause = FIRST_PAUSE  # the next pause's length
        self._paused_until = 0  # no speculation before this step number
        self.speculated = 0  # slices stepped in backward, ever
        self.redone = 0  # of those, slices redone
        self.after_backward = 0  # slices stepped after backward (in step() or forward)
        self.paused_steps = 0  # steps that did not speculate because of a pause

    def allowed(self, step: int) -> bool:
        """Whether step number ``step`` (1 for the first) may speculate."""
        return self.enabled and step >= self._paused_until

    @property
    def pending(self) -> bool:
        """A speculative step began (the store holds its savepoint, :attr:`groups` is set) and
        ``step()`` has not checked it yet."""
        return self.groups is not None

    def begin(self, groups: list[dict[str, Any]]) -> None:
        """A speculative step begins (the store's savepoint is set) with the param groups'
        hyper-parameters ``groups``."""
        self.groups = groups

    def record(self, piece: int, stamps: list[Stamp]) -> None:
        self.stamps[piece] = stamps

    def wrong(
        self,
        slices: Sequence[Slice],
        grads: dict[int, torch.Tensor | None],
        groups_same: list[bool],
        edits: dict[int, list[Any]] | None = None,
    ) -> set[int]:
        """The speculative slices whose step differs from the one ``step()`` would take:
        a gradient changed, appeared or went (``grads``: each slot's gradient now; ``edits``:
        those recorded for the streamed ones), or the param group's hyper-parameters changed
        (``groups_same``)."""
        edits = edits or {}
        wrong: set[int] = set()
        for index, stamps in self.stamps.items():
            piece = slices[index]
            stamped = {stamp.slot for stamp in stamps}
            now = {
                seg.slot.index for seg in piece.segments if grads.get(seg.slot.index) is not None
            }
            if (
                stamped != now
                or not all(groups_same[seg.slot.group] for seg in piece.segments)
                or not all(
                    stamp.holds(grads.get(stamp.slot), edits.get(stamp.slot, ()))
                    for stamp in stamps
                )
            ):
                wrong.add(index)
        return wrong

    def close_step(self, step: int, *, speculated: int, redone: int, after: int) -> None:
        """A step ended: ``speculated`` slices stepped in backward, ``redone`` of them again,
        ``after`` stepped after backward. Two steps in a row with redone slices pause
        speculation (longer each time it fails again right after a pause)."""
        self.stamps.clear()
        self.groups = None
        self.speculated += speculated
        self.redone += redone
        self.after_backward += after
        if not self.allowed(step):
            self.paused_steps += 1
        if not redone:
            if speculated:
                self._streak, self._pause = 0, FIRST_PAUSE
            return
        self._streak += 1
        if self._streak >= 2:
            self._paused_until = step + 1 + self._pause
            self._pause = min(2 * self._pause, LONGEST_PAUSE)
            self._streak = 1  # one more failure after the pause pauses again

    def forget(self) -> None:
        """The speculative slices were rolled back (a step that was not taken)."""
        self.stamps.clear()
        self.groups = None

    def stats(self, step: int) -> dict[str, Any]:
        """What the schedule did: ``mode`` (``"speculate"``: slices step in backward and
        ``step()`` checks them; ``"after backward"``: speculation is paused or off), and the
        slices stepped in backward, redone, and stepped after backward, since the start."""
        return {
            "mode": "speculate" if self.allowed(step + 1) else "after backward",
            "speculated": self.speculated,
            "redone": self.redone,
            "after_backward": self.after_backward,
            "paused_steps": self.paused_steps,
        }
