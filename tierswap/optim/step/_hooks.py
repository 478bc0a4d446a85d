"""Post-accumulate-grad hooks: tell the optimizer when each parameter's gradient is final.

The hooks hold the optimizer weakly (a dropped optimizer leaves no work behind in backward) and
call :meth:`SwapOptimizer.grad_final`, which starts the reads of the parameter's slices, or
steps the slices whose gradients are all final (``overlap="backward"``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = ["GradListener", "register", "remove"]


class GradListener(Protocol):
    """What the hooks call: :meth:`SwapOptimizer.grad_final`."""

    def grad_final(self, param: torch.Tensor) -> None: ...


def register(optimizer: GradListener, params: Iterable[torch.Tensor]) -> list[Any]:
    """Hook every parameter of ``params`` that requires grad; returns the handles."""
    ref = weakref.ref(optimizer)
    return [
        param.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref))
        for param in params
        if param.requires_grad
    ]


def remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _on_grad(ref: weakref.ref[GradListener], param: torch.Tensor) -> None:
    optimizer = ref()
    if optimizer is not None:
        optimizer.grad_final(param)
