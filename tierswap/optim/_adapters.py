"""Adapters: wrap an existing optimizer instance, make a class frameworks can instantiate, or
find the SwapOptimizer inside a framework's wrapper."""

from __future__ import annotations

from typing import Any

import torch

from tierswap.optim.optimizer import SwapOptimizer

__all__ = ["find_swap_optimizer", "offload", "swapped"]


def offload(optimizer: torch.optim.Optimizer, **swap_kwargs: Any) -> SwapOptimizer:
    """Turn an existing optimizer into a :class:`SwapOptimizer`
    (:meth:`SwapOptimizer.from_optimizer`).

    Keeps its class, param groups, hyper-parameters and any state it already holds; the state
    moves into the swap space and the original optimizer must not be stepped again.
    ``swap_kwargs`` are :class:`SwapOptimizer`'s keywords (``swap_dir``, ``host_budget``, ...).
    Anything but a torch optimizer raises ``tierswap.errors.ConfigError`` (a ``TypeError``).
    """
    return SwapOptimizer.from_optimizer(optimizer, **swap_kwargs)


def swapped(optimizer_class: type[torch.optim.Optimizer]) -> type[SwapOptimizer]:
    """A :class:`SwapOptimizer` subclass bound to ``optimizer_class``.

    Its constructor is ``(params, *, swap_dir=..., host_budget=..., **optimizer_kwargs)``, the
    shape frameworks expect of an optimizer class, e.g.
    ``ZeroRedundancyOptimizer(params, optimizer_class=swapped(torch.optim.AdamW), lr=1e-3,
    swap_dir="/nvme/run")``.
    """

    class Swapped(SwapOptimizer):
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, optimizer_class, **kwargs)

    Swapped.__name__ = Swapped.__qualname__ = f"Swapped{optimizer_class.__name__}"
    Swapped.__doc__ = f"{optimizer_class.__name__} with its state swapped by tierswap."
    return Swapped


def find_swap_optimizer(optimizer: Any) -> SwapOptimizer | None:
    """The :class:`SwapOptimizer` that ``optimizer`` is or wraps, else ``None``.

    Trainers wrap optimizers (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``) and keep the wrapped one in ``.optimizer``; up to eight such
    layers are followed.
    """
    for _layer in range(9):
        if optimizer is None or isinstance(optimizer, SwapOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
