"""Post-accumulate-grad hooks: tell the optimizer when each parameter's gradient is final.

The hooks hold the optimizer weakly (a dropped optimizer leaves no work behind in backward) and
call :meth:`SwapOptimizer.grad_final`, which starts the reads of the parameter's slices, or
steps the slices whose gradients are all final (``overlap="backward"``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierswap.optim.optimizer import SwapOptimizer

__all__ = ["register", "remove"]


def register(optimizer: SwapOptimizer, params: Iterable[torch.Tensor]) -> list[Any]:
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


def _on_grad(ref: weakref.ref[SwapOptimizer], param: torch.Tensor) -> None:
    optimizer = ref()
    if optimizer is not None:
        optimizer.grad_final(param)
