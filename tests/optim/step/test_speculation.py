"""overlap="auto" (the default) and "forward": slices step speculatively during backward;
step() checks them and redoes those whose gradients or hyper-parameters changed, bitwise equal
to torch with clipping that triggers never, sometimes or always, GradScaler with skipped steps,
gradient accumulation, closures, LR schedulers and param groups edited between backward and
step. Every test runs both ways: "auto" ends the step in step(), "forward" in the next forward."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.optim.models import assert_same_params, assert_same_state
from tierswap.errors import FailedStepError
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _speculation
from tierswap.optim.step._speculation import FIRST_PAUSE, Stamp, same_groups
from tierswap.pipeline import Pipeline

LAYERS = 6
MODE = {"overlap": "auto"}  # the mode the module's tests run under (the fixture sets it)


@pytest.fixture(autouse=True, params=["auto", "forward"])
def overlap(request, monkeypatch) -> str:
    monkeypatch.setitem(MODE, "overlap", request.param)
    return request.param


class Stack(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(48, 48, dtype=dtype) for _ in range(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(8, 48, generator=gen).to(dtype) for _ in range(n)]


def _swap(model: torch.nn.Module, tmp_path, **kwargs) -> SwapOptimizer:
    settings = {"lr": 1e-2, "weight_decay": 0.1, "host_budget": "48KiB", **MODE}
    settings.update(kwargs)
    return SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, swap_dir=tmp_path / "run", **settings
    )


def _speculated(opt: torch.optim.Optimizer) -> None:
    """Let the worker finish the slices backward handed it (a GPU's backward is long enough
    for that; this model's is not), so that they step before what follows backward."""
    if isinstance(opt, SwapOptimizer):
        opt._stepper.deferred.wait()


def _schedule(opt: SwapOptimizer) -> dict:
    return opt.tier_stats()["schedule"]


def _train(model, opt, batches, *, clip=None, scale=None, edit=None, sched=None, scaler=None):
    """Forward, backward, [unscale], [clip], [edit], step, zero_grad per batch; ``scale(i)``
    multiplies the loss of iteration ``i`` (to make clipping trigger sometimes)."""
    for i, x in enumerate(batches):
        loss = model(x).square().mean() * (scale(i) if scale else 1.0)
        (scaler.scale(loss) if scaler else loss).backward()
        _speculated(opt)
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if edit is not None:
            edit(i, model, opt)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _pair(tmp_path, dtype=torch.float32, **kwargs):
    ref_model, model = Stack(dtype), Stack(dtype)
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, weight_decay=0.1)
    return ref_model, ref, model, _swap(model, tmp_path, **kwargs)


def _check(ref_model, ref, model, opt) -> None:
    opt.synchronize()
    assert_same_params(ref_model, model)
    assert_same_state(ref.state_dict(), opt.state_dict())


@pytest.mark.parametrize("clip", [None, 1e9, "sometimes", 1e-3])
def test_bitwise_with_clipping_never_sometimes_always(clip, tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)
    scale = (lambda i: 1e4 if i % 3 == 2 else 1e-4) if clip == "sometimes" else None
    max_norm = 1.0 if clip == "sometimes" else clip
    batches = _batches(8)
    with opt:
        assert opt.tier_stats()["schedule"]["overlap"] == MODE["overlap"]
        _train(ref_model, ref, batches, clip=max_norm, scale=scale)
        _train(model, opt, batches, clip=max_norm, scale=scale)
        _check(ref_model, ref, model, opt)
        stats = _schedule(opt)
    slices = len(opt.slices)
    if clip in (None, 1e9):  # clip_grad_norm_ multiplied in place by 1.0: nothing changed
        assert stats["speculated"] == 7 * slices  # every step after the first
        assert stats["redone"] == 0
        assert stats["mode"] == "speculate"
    elif clip == "sometimes":  # steps 3 and 6: never two in a row, so no pause
        assert stats["speculated"] == 7 * slices
        assert stats["redone"] == 2 * slices
        assert stats["paused_steps"] == 0
    else:  # every step: steps 2 and 3 redo all, which pauses speculation
        assert stats["speculated"] == stats["redone"] == 2 * slices
        assert stats["mode"] == "after backward"
        assert stats["paused_steps"] == 8 - 3


def test_speculation_resumes_after_its_pause(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)
    steps = 3 + FIRST_PAUSE + 2
    batches = _batches(steps)

    def scale(i: int) -> float:  # clipping triggers in steps 2 and 3, then never
        return 1e4 if i in (1, 2) else 1e-4

    with opt:
        _train(ref_model, ref, batches, clip=1.0, scale=scale)
        _train(model, opt, batches, clip=1.0, scale=scale)
        _check(ref_model, ref, model, opt)
        stats = _schedule(opt)
    assert stats["paused_steps"] == FIRST_PAUSE
    assert stats["mode"] == "speculate"
    assert stats["speculated"] == (steps - 1 - FIRST_PAUSE) * len(opt.slices)


@pytest.mark.parametrize("commit_every", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_slices_speculate_where_the_step_before_committed(
    commit_every, dtype, tmp_path
) -> None:
    """Slices resident in host memory step in backward where the store holds their pre-step
    values without a write: the step before committed, and each parameter has a master (bf16
    ones); a redo reads their state back from the store. fp32 parameters (no master) would
    need their pre-step copies written: their resident slices step after backward. Clipping
    triggers in steps 3 and 6. Bitwise the plain optimizer (tierswap's in memory for bf16)."""
    ref_model, ref, model, opt = _pair(
        tmp_path, dtype=dtype, host_budget=None, commit_every=commit_every
    )
    if dtype == torch.bfloat16:
        ref = SwapOptimizer(
            ref_model.named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
            swap_dir=tmp_path / "ref", overlap=None,
        )  # fmt: skip
    scale = lambda i: 1e4 if i % 3 == 2 else 1e-4  # noqa: E731
    batches = _batches(8, dtype)
    with opt:
        assert len(opt.placement) == len(opt.slices)  # every slice resident
        _train(ref_model, ref, batches, clip=1.0, scale=scale)
        _train(model, opt, batches, clip=1.0, scale=scale)
        opt.synchronize()
        assert_same_params(ref_model, model)
        stats = _schedule(opt)
    # commits every 2 steps: 2, 4 and 6, so steps 3, 5 and 7 speculate, and 2: the first
    # step, which creates the state (in a work buffer of its own), keeps no slice resident
    speculating, redone = (
        ([2, 3, 4, 5, 6, 7, 8], [3, 6]) if commit_every == 1 else ([2, 3, 5, 7], [3])
    )
    if dtype == torch.float32:
        speculating = redone = []
    expected = len(speculating) * len(opt.slices), len(redone) * len(opt.slices)
    if MODE["overlap"] == "auto":
        assert (stats["speculated"], stats["redone"]) == expected
    else:  # the step that runs into the next forward may not have ended when backward asks
        assert stats["speculated"] <= expected[0]
        assert stats["redone"] <= expected[1]


def test_a_resident_slice_does_not_speculate_while_the_step_before_runs(
    tmp_path, monkeypatch
) -> None:
    """With ``"forward"`` the next backward may begin while the step before still runs on the
    worker (the forward waited for its parameters alone), maybe before that step has kept a
    resident slice's results: the pipeline, the worker's then, would tell a store one step
    behind for current (a redo would start from it: found bitwise wrong under load). The
    slice steps after backward instead, and the pipeline is not asked."""
    _, _, model, opt = _pair(tmp_path, dtype=torch.bfloat16, host_budget=None, commit_every=1)
    stepper, release, asked = opt._stepper, threading.Event(), []
    with opt:
        _train(model, opt, _batches(2, torch.bfloat16))  # state made, resident, committed
        opt.synchronize()
        piece = opt.slices[0]
        assert piece.index in opt.placement
        monkeypatch.setattr(Pipeline, "unflushed", lambda self, name: asked.append(name) or False)
        assert stepper._speculable(piece)  # the worker idle: the pipeline answers
        assert asked == [piece.index]
        stepper.deferred.start({}, lambda: release.wait(timeout=10))  # a step under way
        try:
            assert not stepper._speculable(piece)
        finally:
            release.set()
            stepper.deferred.wait()
        assert asked == [piece.index]


def test_resident_slices_of_a_step_not_taken_are_rolled_back(tmp_path) -> None:
    """Resident slices speculated for a step that is not taken (``zero_grad`` drops its
    gradients): their state and masters are read back from the store, their parameters too."""
    ref_model, ref, model, opt = _pair(
        tmp_path, dtype=torch.bfloat16, host_budget=None, commit_every=1
    )
    ref = SwapOptimizer(
        ref_model.named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        swap_dir=tmp_path / "ref", overlap=None,
    )  # fmt: skip
    batches = _batches(5, torch.bfloat16)
    with opt, ref:
        _train(ref_model, ref, batches[:3])
        _train(model, opt, batches[:3])
        opt.synchronize()  # ("forward": the last step's commit ends before backward asks)
        before = [p.detach().clone() for p in model.parameters()]
        model(batches[3]).square().mean().backward()
        _speculated(opt)
        assert opt._stepper.speculation.pending  # resident slices stepped...
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        opt.zero_grad()  # ...for a step that is not taken
        assert_same_params(ref_model, model)
        _train(ref_model, ref, batches[4:])
        _train(model, opt, batches[4:])
        opt.synchronize()
        assert_same_params(ref_model, model)
        assert_same_state(ref.state_dict(), opt.state_dict())


def test_only_the_slices_of_an_edited_gradient_are_redone(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)

    def edit(i, m, _opt) -> None:
        if i == 2:
            m.layers[3].weight.grad.mul_(0.5)  # in place: its version moves, its bytes change
        if i == 3:
            m.layers[2].weight.grad.mul_(1.0)  # in place, same bytes: not redone
        if i == 4:
            m.layers[1].bias.grad = m.layers[1].bias.grad * 2.0  # a new tensor

    batches = _batches(6)
    with opt:
        _train(ref_model, ref, batches, edit=edit)
        _train(model, opt, batches, edit=edit)
        _check(ref_model, ref, model, opt)
        stats = _schedule(opt)
        redone = sum(
            len(opt._layout.slices_of[opt._layout.slot_of[id(p)].index])
            for p in (model.layers[3].weight, model.layers[1].bias)
        )
    assert stats["redone"] == redone
    assert stats["mode"] == "speculate"  # never two steps in a row


def test_hyper_parameters_changed_between_backward_and_step_redo_their_group(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)

    def edit(i, _m, o) -> None:
        if i == 2:
            o.param_groups[0]["lr"] = 3e-3
        if i == 4:
            o.param_groups[0]["weight_decay"] = 0.0  # two steps later: no pause

    batches = _batches(6)
    with opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.8)
        _train(ref_model, ref, batches, edit=edit, sched=ref_sched)
        _train(model, opt, batches, edit=edit, sched=sched)
        _check(ref_model, ref, model, opt)
        assert _schedule(opt)["redone"] == 2 * len(opt.slices)


def test_grad_scaler_with_skipped_steps(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2) for _ in "ab"]
    batches = _batches(8)

    def scale(i: int) -> float:  # infinite gradients in steps 3 and 6: the scaler skips them
        return float("inf") if i in (2, 5) else 1.0

    with opt:
        _train(ref_model, ref, batches, scaler=scalers[0], scale=scale)
        _train(model, opt, batches, scaler=scalers[1], scale=scale)
        _check(ref_model, ref, model, opt)
        assert scalers[1].get_scale() == scalers[0].get_scale()
        assert ref.state[ref_model.layers[0].weight]["step"].item() == 6


def test_a_step_not_taken_is_rolled_back(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)
    batches = _batches(5)
    with opt:
        _train(ref_model, ref, batches[:3])
        _train(model, opt, batches[:3])
        before = [p.detach().clone() for p in model.parameters()]
        model(batches[3]).square().mean().backward()
        _speculated(opt)
        assert opt._stepper.speculation.pending  # slices stepped...
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        opt.zero_grad()  # ...for a step that is not taken
        for a, b in zip(before, model.parameters(), strict=True):
            assert torch.equal(a, b)
        _train(ref_model, ref, batches[4:])
        _train(model, opt, batches[4:])
        _check(ref_model, ref, model, opt)


def test_gradient_accumulation_is_learnt_and_a_forward_rolls_back(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path)
    batches = _batches(8)
    passes = [1, 1, 3, 3]  # backward passes per step: the third step changes them

    def train(m, o) -> None:
        i = 0
        for n in passes:
            for x in batches[i : i + n]:
                m(x).square().mean().backward()
                _speculated(o)  # the slices step: in step 3, the next forward rolls them back
            i += n
            o.step()
            o.zero_grad()

    with opt:
        train(ref_model, ref)
        train(model, opt)
        _check(ref_model, ref, model, opt)
        stats = _schedule(opt)
    # step 1 creates the state; steps 2 and 4 speculate on their last pass; step 3 did on its
    # first, rolled back when its second forward began, and stepped after backward
    assert stats["speculated"] == 2 * len(opt.slices)
    assert stats["redone"] == 0


def test_closures_and_accumulation_steps(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path, accumulation_steps=2)
    batches = _batches(8)

    def train(m, o) -> None:
        for i in range(0, len(batches), 2):

            def closure(pair=batches[i : i + 2]):
                for x in pair:
                    m(x).square().mean().backward()

            o.step(closure)
            o.zero_grad()

    with opt:
        train(ref_model, ref)
        train(model, opt)
        _check(ref_model, ref, model, opt)


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_bf16_params_redo_from_their_masters(master, tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path, dtype=torch.bfloat16, master=master)
    # the plain optimizer with the same master: tierswap's in-memory run is the reference
    ref = SwapOptimizer(
        ref_model.named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        swap_dir=tmp_path / "ref", master=master, overlap=None,
    )  # fmt: skip
    batches = _batches(6, torch.bfloat16)
    with opt, ref:
        _train(ref_model, ref, batches, clip=1e-3)
        _train(model, opt, batches, clip=1e-3)
        opt.synchronize()
        assert_same_params(ref_model, model)
        assert _schedule(opt)["redone"] == 2 * len(opt.slices)


def test_8bit_state_does_not_speculate(tmp_path) -> None:
    model = Stack()
    with _swap(model, tmp_path, state_precision="8bit") as opt:
        _train(model, opt, _batches(3))
        stats = _schedule(opt)
    assert stats["speculated"] == 0
    assert stats["mode"] == "after backward"


def test_commits_and_resume_hold_the_checked_step(tmp_path) -> None:
    ref_model, ref, model, opt = _pair(tmp_path, commit_every=1)
    batches = _batches(5)
    with opt:
        _train(ref_model, ref, batches, clip=1e-3)
        _train(model, opt, batches, clip=1e-3)
        _check(ref_model, ref, model, opt)
    again = Stack()
    with _swap(again, tmp_path, commit_every=1, resume=True) as opt:
        assert opt.steps == 5
        assert_same_params(ref_model, again)
        assert_same_state(ref.state_dict(), opt.state_dict())


def test_stamps_see_every_change_of_the_bytes() -> None:
    grad = torch.arange(10, dtype=torch.float32)
    stamp = Stamp.of(0, grad, 2, 6)
    assert stamp.holds(grad)
    grad.mul_(1.0)  # version moved, bytes did not
    assert stamp.holds(grad)
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    torch._amp_foreach_non_finite_check_and_unscale_([grad], found, inv)  # version stays
    assert not stamp.holds(grad)
    grad.mul_(2.0)
    assert stamp.holds(grad)
    grad.data[4] += 1.0  # through .data: version stays
    assert not stamp.holds(grad)
    grad.data[4] -= 1.0
    assert not stamp.holds(grad.to(torch.float64))
    grad[7] = 100.0  # outside the segment
    assert stamp.holds(grad)
    grad[3] = -1.0
    assert not stamp.holds(grad)
    assert not stamp.holds(None)
    assert stamp.holds(torch.arange(10, dtype=torch.float32))  # another tensor, same bytes


def test_same_groups_compares_tensors_by_value() -> None:
    a = [{"lr": torch.tensor(0.1), "betas": (0.9, 0.99)}, {"lr": 0.2}]
    b = [{"lr": torch.tensor(0.1), "betas": (0.9, 0.99)}, {"lr": 0.3}]
    assert same_groups(a, b) == [True, False]
    assert same_groups(a, a[:1]) == [True, False]


def test_a_redo_that_fails_fails_the_step_and_keeps_the_last_commit(tmp_path, overlap) -> None:
    _ref_model, _ref, model, opt = _pair(tmp_path, commit_every=1)
    batches = _batches(4)
    _train(model, opt, batches[:2])  # committed at step 2
    opt.synchronize()
    saved = [p.detach().clone() for p in model.parameters()]

    def broken(regions) -> None:
        list(regions)
        raise OSError(5, "injected: the rollback's store is gone")

    opt._backend.roll_back = broken  # type: ignore[method-assign]
    model(batches[2]).square().mean().backward()
    _speculated(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # every slice must be redone
    if overlap == "auto":  # the redo runs in step()
        with pytest.raises(OSError, match="injected"):
            opt.step()
    else:  # after step() returned
        opt.step()
        with pytest.raises(OSError, match="injected"):
            opt.synchronize()
    with pytest.raises(FailedStepError):
        opt.commit()
    assert opt.steps == 2  # not taken: close() has no step to commit, the folder keeps step 2
    opt.close()
    again = Stack()
    with _swap(again, tmp_path, commit_every=1, resume=True) as resumed:
        assert resumed.steps == 2
        for a, b in zip(saved, again.parameters(), strict=True):
            assert torch.equal(a, b)


def test_ddp_gradients_are_not_speculated_on(tmp_path, monkeypatch) -> None:
    """Under a process group of several ranks, plain-tensor gradients (DDP's) are averaged
    only when backward ends: the hooks see each rank's local one, so nothing is speculated
    (every slice would be redone); the steps run after backward, bitwise as before."""
    monkeypatch.setattr(_speculation, "world", lambda: (0, 2))
    ref_model, ref, model, opt = _pair(tmp_path)
    batches = _batches(4)
    with opt:
        _train(ref_model, ref, batches)
        _train(model, opt, batches)
        _check(ref_model, ref, model, opt)
        schedule = _schedule(opt)
        assert schedule["mode"] == "after backward"
        assert schedule["speculated"] == 0
        assert schedule["after_backward"] == 4 * len(opt.slices)


@pytest.mark.parametrize("how", ["wrapper", "in_place"])
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_model_speculates_bitwise(how, overlap, tmp_path) -> None:
    """torch.compile traces the optimizer's global forward pre-hook: inside the trace it does
    nothing (no graph break, no crash), and the compiled wrapper's eager call waits for and
    guards every parameter under it. A module compiled in place (``module.compile()``) has no
    eager call: with "auto" nothing needs one; "forward" would race (documented)."""
    if how == "in_place" and overlap == "forward":
        pytest.skip('overlap="forward" needs torch.compile(model), not model.compile()')
    ref_model, ref, model, opt = _pair(tmp_path)
    graphs: list[object] = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    if how == "wrapper":
        compiled = torch.compile(model, backend=backend)
    else:
        compiled = model
        model.compile(backend=backend)
    batches = _batches(5)
    with opt:
        _train(ref_model, ref, batches)
        _train(compiled, opt, batches)
        _check(ref_model, ref, model, opt)
        assert _schedule(opt)["speculated"] > 0
    assert len(graphs) == 1  # one graph: the hook breaks nothing


def test_a_failed_speculation_found_by_another_call_is_rolled_back(tmp_path, monkeypatch) -> None:
    """A speculative slice that fails is raised by whichever call waits for the worker first
    (here synchronize(), as state_dict() or commit() would): the slices that did step are
    rolled back before it raises, and the step is not committed."""
    _ref_model, _ref, model, opt = _pair(tmp_path, commit_every=1)
    batches = _batches(3)
    _train(model, opt, batches[:2])
    saved = [p.detach().clone() for p in model.parameters()]
    real = opt._stepper.runner.work
    calls = []

    def fails_second(plan, job, tensors, **kwargs):
        calls.append(job.name)
        if len(calls) == 2:
            raise OSError(5, "injected: the second slice's disk is gone")
        return real(plan, job, tensors, **kwargs)

    monkeypatch.setattr(opt._stepper.runner, "work", fails_second)
    model(batches[2]).square().mean().backward()
    with pytest.raises(OSError, match="injected"):
        opt.synchronize()
    assert len(calls) >= 2  # one slice stepped before the failure, and was rolled back
    for a, b in zip(saved, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt._state.failed
    with pytest.raises(FailedStepError):
        opt.commit()
    opt.close()
