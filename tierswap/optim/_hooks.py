"""Post-accumulate-grad hooks: prefetch state during backward, or step in the hook.

The schedule is the reverse of registration order, which is the order gradients usually become
final. When a parameter's gradient is final its partition's tensors are requested from the
cache, so the first partitions ``step()`` needs are resident (or in flight) when it starts.
With ``overlap="backward"`` the hook steps the parameter itself once its gradient has been
accumulated ``accumulation_steps`` times, then frees the gradient.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierswap.optim.optimizer import SwapOptimizer

__all__ = ["new_cycle", "register", "remove"]


def register(optimizer: SwapOptimizer) -> list[Any]:
    """Hook every parameter that requires grad; returns the handles."""
    new_cycle(optimizer)
    optimizer._grad_counts = {}
    ref = weakref.ref(optimizer)
    return [
        slot.param.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref))
        for slot in optimizer._slots
        if slot.param.requires_grad
    ]


def remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def new_cycle(optimizer: SwapOptimizer) -> None:
    """Forget which partitions were prefetched: a new backward pass begins."""
    optimizer._prefetched = set()
    optimizer._prefetched_bytes = 0


def _on_grad(ref: weakref.ref[SwapOptimizer], param: torch.Tensor) -> None:
    optimizer = ref()
    if optimizer is None or optimizer._backend._closed:
        return
    slot = optimizer._slot_of.get(id(param))
    if slot is None:
        return
    if optimizer._config.overlap == "backward":
        _step_in_hook(optimizer, slot)
    else:
        _prefetch_partition(optimizer, slot)


def _prefetch_partition(optimizer: SwapOptimizer, slot: Any) -> None:
    part = optimizer._slot_partition[slot.index]
    if part.index in optimizer._prefetched:
        return
    if optimizer._prefetched_bytes + part.working_set > optimizer._tier_budget():
        return  # would push out state needed sooner; step() prefetches the rest
    if not optimizer._prefetched:
        optimizer._backend.settle()  # the last step's write-behind must not race these reads
    optimizer._prefetched.add(part.index)
    optimizer._prefetched_bytes += part.working_set
    optimizer._backend.prefetch(optimizer._keys(part.slots))


def _step_in_hook(optimizer: SwapOptimizer, slot: Any) -> None:
    count = optimizer._grad_counts.get(slot.index, 0) + 1
    optimizer._grad_counts[slot.index] = count
    if count % optimizer._config.accumulation_steps:
        return
    with torch.no_grad():
        optimizer._step_slots([slot])
    optimizer._stepped.add(slot.index)
    slot.param.grad = None
