"""Post-accumulate-grad hooks: start the step's I/O during backward, or step in the hook.

The schedule is the reverse of registration order, which is the order gradients usually become
final. When a parameter's gradient is final the reads of its slices start at once (as far as the
pipeline's budget allows), so the state ``step()`` needs first is in memory or in flight when it
starts. With ``overlap="backward"`` a slice steps inside the hook as soon as the gradients of all
its parameters are final (every ``accumulation_steps`` backward passes); a parameter's gradient
is freed once all its slices have stepped.
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
    """Forget which parameters were final: a new step begins."""
    optimizer._final = set()


def _on_grad(ref: weakref.ref[SwapOptimizer], param: torch.Tensor) -> None:
    optimizer = ref()
    if optimizer is None or optimizer._backend.closed:
        return
    slot = optimizer._slot_of.get(id(param))
    if slot is None:
        return
    if optimizer._config.overlap == "backward":
        _step_in_hook(optimizer, slot.index)
    else:
        pieces = optimizer._slices_of[slot.index]
        optimizer._backend.pipeline.prefetch([optimizer.job(piece) for piece in pieces])


def _step_in_hook(optimizer: SwapOptimizer, index: int) -> None:
    count = optimizer._grad_counts.get(index, 0) + 1
    optimizer._grad_counts[index] = count
    if count % optimizer._config.accumulation_steps:
        return
    optimizer._final.add(index)
    ready = [
        piece
        for piece in optimizer._slices_of[index]
        if piece.index not in optimizer._stepped
        and all(
            seg.slot.index in optimizer._final or not seg.slot.param.requires_grad
            for seg in piece.segments
        )
    ]
    if ready:
        with torch.no_grad():
            optimizer.step_slices(ready)
    for slot_index in {seg.slot.index for piece in ready for seg in piece.segments}:
        if all(p.index in optimizer._stepped for p in optimizer._slices_of[slot_index]):
            optimizer._slots[slot_index].param.grad = None
