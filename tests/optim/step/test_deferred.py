"""overlap="forward": step() returns at once; the slices step while the next forward runs, each
module waiting only for its own parameters; bitwise equal to torch with clipping, GradScaler,
LR schedulers and closures."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from tests.optim.models import assert_same_params, assert_same_state
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _stepper as stepper_module
from tierswap.optim.step._deferred import NICENESS, DeferredSteps

LAYERS = 6


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(8, 48, generator=gen) for _ in range(n)]


def _swap(model, tmp_path, **kwargs) -> SwapOptimizer:
    return SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        swap_dir=tmp_path / "run", host_budget="48KiB", overlap="forward", **kwargs,
    )  # fmt: skip


def _iteration(model, opt, sched, x, scaler=None) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean()
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    sched.step()
    return loss.detach()


@pytest.mark.parametrize("scaled", [False, True])
def test_forward_overlap_is_bitwise_with_clipping_and_schedulers(scaled, tmp_path) -> None:
    ref_model, model = Stack(), Stack()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, weight_decay=0.1)
    opt = _swap(model, tmp_path)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None for _ in "ab"]
    with opt:
        assert len(opt.slices) > 2
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (ref, opt)]
        for x in _batches(5):
            ref_loss = _iteration(ref_model, ref, scheds[0], x, scalers[0])
            loss = _iteration(model, opt, scheds[1], x, scalers[1])
            assert torch.equal(ref_loss, loss)  # the forward saw the updated weights
        opt.synchronize()
        assert_same_params(ref_model, model)
        assert_same_state(ref.state_dict(), opt.state_dict())
        assert opt.steps == 5


def test_step_returns_before_the_slices_and_forward_waits_per_module(tmp_path, monkeypatch) -> None:
    ref_model, model = Stack(), Stack()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, weight_decay=0.1)
    opt = _swap(model, tmp_path)
    gate = threading.Event()
    work = opt._stepper.runner.work

    def slow_work(plan, job, tensors, **kwargs):  # the disk, slowed: slices end after step()
        gate.wait(10)
        return work(plan, job, tensors, **kwargs)

    monkeypatch.setattr(opt._stepper.runner, "work", slow_work)
    with opt:
        x = _batches(1)[0]
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        ref.step()
        started = time.perf_counter()
        opt.step()
        assert opt._deferred.busy  # returned while every slice is still to step
        assert time.perf_counter() - started < 5
        threading.Timer(0.2, gate.set).start()
        out = model(x)  # waits, module by module, for the updated weights
        assert torch.equal(out, ref_model(x))
        opt.synchronize()
        assert not opt._deferred.busy


def test_the_steps_gradients_go_before_its_commit_ends(tmp_path, monkeypatch) -> None:
    """A commit that runs on into the next iteration holds no gradient of its step: the next
    backward's gradients would come on top of them, two sets at once."""
    model = Stack()
    opt = _swap(model, tmp_path, commit_every=1)
    committing, gate = threading.Event(), threading.Event()
    commit = stepper_module.commit

    def slow_commit(parts):  # the commit, slowed: it lasts into the next iteration
        committing.set()
        gate.wait(10)
        return commit(parts)

    monkeypatch.setattr(stepper_module, "commit", slow_commit)
    with opt:
        x = _batches(1)[0]
        opt.zero_grad()
        model(x).square().mean().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        try:
            assert committing.wait(10)  # every slice stepped; the commit is under way
            gc.collect()
            assert [g() for g in grads] == [None] * len(grads)
        finally:
            gate.set()
        opt.synchronize()
        assert opt.steps == 1


def test_a_closure_and_state_dicts_wait(tmp_path) -> None:
    ref_model, model = Stack(), Stack()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, weight_decay=0.1)
    opt = _swap(model, tmp_path)
    with opt:
        for x in _batches(3):
            for m, o in ((ref_model, ref), (model, opt)):

                def closure(m=m, o=o, x=x) -> torch.Tensor:
                    o.zero_grad()
                    loss = m(x).square().mean()
                    loss.backward()
                    return loss

                o.step(closure)
            assert_same_state(ref.state_dict(), opt.state_dict())  # waits for the step
        opt.zero_grad(set_to_none=False)  # in place: waits, then zeros
        assert_same_params(ref_model, model)


def test_a_failed_deferred_step_is_raised_and_not_committed(tmp_path, monkeypatch) -> None:
    model = Stack()
    opt = _swap(model, tmp_path, commit_every=1)
    model(_batches(1)[0]).sum().backward()
    opt.step()
    opt.synchronize()

    def broken(plan, job, tensors, **kwargs):
        raise OSError(5, "Input/output error")

    model(_batches(1)[0]).sum().backward()
    opt._stepper.deferred.wait()  # the slices speculated in backward have stepped
    monkeypatch.setattr(opt._stepper.runner, "work", broken)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # all of them must be redone
    opt.step()  # returns: the failure comes from the worker
    with pytest.raises(OSError, match="Input/output"):
        opt.synchronize()
    assert opt.steps == 1  # the failed step is not counted: the last commit holds them all
    opt.close()
    resumed = SwapOptimizer(
        Stack().named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        swap_dir=tmp_path / "run", host_budget="48KiB", resume=True,
    )  # fmt: skip
    with resumed:
        assert resumed.steps == 1  # the last commit, not the failed step


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities: Linux")
def test_the_worker_runs_nicer_than_the_training_thread() -> None:
    """A model computed on the CPU keeps its cores: the worker (speculative slices, the step
    carried into forward) runs at a lower CPU priority than the thread that made it."""
    steps = DeferredSteps()
    seen: list[int] = []
    steps.queue(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    try:
        steps.wait()
    finally:
        steps.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, mine + NICENESS)]
    assert mine == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # unchanged
