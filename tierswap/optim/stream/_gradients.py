"""The gradients of streamed parameters, kept in the swap space from backward to the step.

As backward finalizes a streamed parameter's gradient, :class:`KeptGradients` puts it where
the step reads it (into its resident slice, or written behind to the store), adds it to the one
kept since the last ``zero_grad()`` when backward passes accumulate (as torch adds into
``param.grad``), and notes its 2-norm (and, once a ``GradScaler`` has asked, whether it is
finite). ``param.grad`` then holds an :class:`~tierswap.optim.stream._placeholder.
OffloadedGradient` stand-in whose keeper this is: torch's clipping asks it the norms and records
its factor, a scaler's unscale asks whether each gradient is finite and records its factor, and
the step applies the recorded edits as it reads the gradient. Private to
:mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierswap.errors import GradientOffloadedError
from tierswap.optim.persist import OptimizerParts
from tierswap.optim.plan import GradClamp, Slot, apply_grad_edits
from tierswap.optim.stream._placeholder import norm_as_torch
from tierswap.optim.stream._swap import empty_for_upload, keep_grad

__all__ = ["KeptGradients"]


class KeptGradients:
    """The streamed parameters' kept gradients of ``parts`` (the
    :class:`~tierswap.optim.stream._placeholder.GradientKeeper` of their stand-ins).

    ``read`` fills each flat tensor of a dict (slot index -> tensor) with that slot's kept
    gradient, as stored. Called from the training thread and from the thread autograd runs
    backward on, one at a time (the parameter stream's rule)."""

    def __init__(
        self, parts: OptimizerParts, read: Callable[[dict[int, torch.Tensor]], None]
    ) -> None:
        self.parts = parts
        self._read = read
        #: The 2-norm of each kept gradient (for ``clip_grad_norm_``), by slot index.
        self.norms: dict[int, torch.Tensor] = {}
        #: Whether each kept gradient is finite (for a ``GradScaler``), noted in backward once
        #: a scaler has asked (``_note_finite``): before that the first ask reads it back.
        self.finite: dict[int, bool] = {}
        self._note_finite = False
        self._accumulating: set[int] = set()  # slots whose kept gradient this pass adds to
        self.kept_bytes = 0  # gradients put in the swap space

    def begin_pass(self, accumulating: set[int]) -> None:
        """A backward pass begins; it adds to the gradients kept for the slots
        ``accumulating`` (their stand-ins were in ``param.grad``)."""
        self._accumulating = accumulating

    def take(self, slot: Slot, grad: torch.Tensor, *, keep: bool) -> torch.Tensor:
        """``slot``'s gradient ``grad`` is final in this backward pass: add it to the one kept
        (scaled as clipped so far, as in torch), keep the sum unless ``keep`` is false (no step
        reads it from the swap space), note its norm and finiteness; returns the sum."""
        index = slot.index
        with torch.no_grad():
            if index in self._accumulating:
                grad = self.read(index).add_(grad)
            self.parts.state.grad_edits.pop(index, None)
            if keep:
                keep_grad(self.parts.backend.pipeline, self.parts.layout, slot, grad)
                self.kept_bytes += grad.numel() * grad.element_size()
                self.norms[index] = norm_as_torch(grad, 2.0)
            if self._note_finite:
                low, high = grad.aminmax()  # both finite: no inf, no NaN (they propagate)
                self.finite[index] = bool(torch.isfinite(low) & torch.isfinite(high))
            else:
                self.finite.pop(index, None)
        return grad

    def grad_norm(self, index: int, ord: float) -> torch.Tensor:
        """The ``ord``-norm of slot ``index``'s kept gradient, as torch would compute it on the
        gradient in memory (:func:`norm_as_torch`): the 2-norm noted as backward finalized it,
        or, after a recorded edit or for another norm, computed on the gradient read back."""
        self._check_not_stepped()
        edits = self.parts.state.grad_edits.get(index)
        if ord == 2.0 and not edits and index in self.norms:
            return self.norms[index].clone()
        return norm_as_torch(self.read(index), ord)

    def grad_finite(self, index: int) -> bool:
        """Whether slot ``index``'s kept gradient, edited as recorded, has no inf or NaN (what
        a ``GradScaler``'s unscale checks): noted in backward, or read back (and from then on
        noted in every backward)."""
        self._check_not_stepped()
        if not self.parts.state.grad_edits.get(index) and index in self.finite:
            return self.finite[index]
        self._note_finite = True
        return bool(torch.isfinite(self.read(index)).all())

    def scale_grad(self, index: int, factor: Any) -> None:
        """Record that slot ``index``'s kept gradient is multiplied by ``factor`` in place (the
        step, or a later accumulation, applies it)."""
        self._check_not_stepped()
        self.parts.state.grad_edits.setdefault(index, []).append(_recorded(factor))

    def clamp_grad(self, index: int, low: Any, high: Any) -> None:
        """Record that slot ``index``'s kept gradient is clamped into ``[low, high]`` in place
        (``torch.nn.utils.clip_grad_value_``; a bound may be ``None``)."""
        self._check_not_stepped()
        edit = GradClamp(_recorded(low), _recorded(high))
        self.parts.state.grad_edits.setdefault(index, []).append(edit)

    def read(self, index: int) -> torch.Tensor:
        """Slot ``index``'s kept gradient, read back, with the edits recorded for it applied
        (they stay recorded: the step applies them to the kept gradient)."""
        grad = empty_for_upload(self.parts.layout.slots[index].param)
        self._read({index: grad.view(-1)})
        return apply_grad_edits(grad, self.parts.state.grad_edits.get(index, ()))

    def _check_not_stepped(self) -> None:
        """Raise ``GradientOffloadedError`` under ``overlap="backward"``: the slices stepped
        with each gradient in backward, so clipping or unscaling it now would change
        nothing, silently."""
        if self.parts.config.overlap == "backward":
            raise GradientOffloadedError(
                "with overlap='backward' each gradient stepped in backward, before clipping "
                "or a GradScaler could change it; use overlap='auto' (the default: steps in "
                "backward too, checked by step(), redone where clipping changed them)"
            )


def _recorded(value: Any) -> Any:
    """A clipping factor or bound as recorded: a tensor copied (the caller may reuse it)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
