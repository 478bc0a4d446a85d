"""Reads of the next modules' parameters started ahead of their use
(``tierswap.optim.stream._ahead.ReadsAhead``): now, or once a step that runs into the forward
has updated them; dropped whole."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from tests.optim.models import batch_for_step, make_models
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream._ahead import ReadsAhead
from tierswap.optim.stream._into_forward import NoStep


class PendingStep(NoStep):
    """A step into the forward that has still to update the parameters in ``pending``."""

    def __init__(self) -> None:
        self.pending_ids: set[int] = set()
        self.each: weakref.WeakMethod[Callable[[], None]] | None = None

    def pending(self, param: torch.Tensor) -> bool:
        return id(param) in self.pending_ids

    def after_each_slice(self, call: weakref.WeakMethod[Callable[[], None]]) -> None:
        self.each = call

    def slice_done(self) -> None:
        call = self.each() if self.each is not None else None
        if call is not None:
            call()


def _train(model: torch.nn.Module, opt: SwapOptimizer, step: int) -> None:
    model(batch_for_step(step)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_reads_wait_for_the_step_that_updates_their_parameters(tmp_path: Path) -> None:
    """A parameter the step into the forward has still to update is read once it has (after
    a slice), not before (it would read the old master); ``drop`` gives every read back."""
    _, model = make_models()
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=65536, policy="lru",
        offload_parameters=True,
    )  # fmt: skip
    assert opt.placement == {}  # every slice streams: reads go to the store
    _train(model, opt, 0)
    pipeline, slot_of = opt._parts.backend.pipeline, opt._parts.layout.slot_of
    weight, bias = (slot_of[id(p)].index for p in (model.mid.weight, model.mid.bias))
    step = PendingStep()
    ahead = ReadsAhead(opt._parts, step)
    held = pipeline.held

    step.pending_ids = {id(model.mid.weight)}
    ahead.start([weight, bias])
    assert {name[1] for name in ahead.names} == {bias}  # the weight waits for its slices
    step.slice_done()  # a slice that did not update it
    assert {name[1] for name in ahead.names} == {bias}
    step.pending_ids.clear()
    step.slice_done()  # the slice that did
    assert {name[1] for name in ahead.names} == {weight, bias}
    assert pipeline.held > held

    step.pending_ids = {id(model.mid.weight)}
    ahead.start([weight])  # a later use: what waits is replaced
    ahead.drop()
    assert not ahead.names
    assert pipeline.held == held
    step.pending_ids.clear()
    step.slice_done()  # nothing waits any more: nothing is read
    assert not ahead.names
    assert pipeline.held == held
    opt.close()


def test_reads_ahead_the_next_modules_after_the_first_step(tmp_path: Path) -> None:
    """From the second iteration on (the order of uses recorded), a module's forward finds the
    reads of its parameters started ahead."""
    _, model = make_models()
    opt = SwapOptimizer(
        model, torch.optim.AdamW, swap_dir=tmp_path, host_budget=65536, policy="lru",
        offload_parameters=True,
    )  # fmt: skip
    assert opt.placement == {}  # every slice streams: the parameters are read from disk
    ahead: list[int] = []
    model.mid.register_forward_pre_hook(lambda *_: ahead.append(len(opt._stream._ahead.names)))
    for step in range(3):
        _train(model, opt, step)
    assert ahead[0] == 0  # the first iteration records the order
    assert all(n > 0 for n in ahead[1:]), ahead
    opt.close()
