"""The optimizer's step that runs into the next forward (``overlap="forward"``), as the
parameter stream sees it: while it runs, its thread is the pipeline's user, so the stream's
calls into the pipeline from the forward run there (:meth:`StepIntoForward.serve`), a use of a
parameter waits for that parameter's slices, reads ahead skip parameters whose slices have not
stepped yet (the step calls the stream back after each slice), and backward waits for the
step to end. :class:`~tierswap.optim.step.DeferredSteps` is the one the optimizer passes;
:class:`NoStep` stands in under the other schedules.

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import torch

__all__ = ["NoStep", "StepIntoForward"]

T = TypeVar("T")


class StepIntoForward(Protocol):
    """The optimizer's step that runs into the next forward (``overlap="forward"``: the
    worker of :class:`~tierswap.optim.step.DeferredSteps`), as the stream sees it."""

    def serve(self, call: Callable[[], T]) -> T:
        """``call()`` on the thread that uses the pipeline now (the step's, while it runs)."""
        ...

    def wait(self) -> None:
        """Wait for the step to end (raising its failure)."""
        ...

    def pending(self, param: torch.Tensor) -> bool:
        """Whether the step has still to update ``param``."""
        ...

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Wait until the step has updated ``params``."""
        ...

    def after_each_slice(self, call: weakref.WeakMethod[Callable[[], None]]) -> None:
        """Call ``call`` on the step's thread after each of its slices (while it lives)."""
        ...


class NoStep:
    """No step runs into the forward: every call runs here."""

    def serve(self, call: Callable[[], T]) -> T:
        return call()

    def wait(self) -> None:
        pass

    def pending(self, param: torch.Tensor) -> bool:
        return False

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        pass

    def after_each_slice(self, call: weakref.WeakMethod[Callable[[], None]]) -> None:
        pass
