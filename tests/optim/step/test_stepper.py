"""The stepper: which slices a step runs, when, and what it leaves behind."""

from __future__ import annotations

import pytest
import torch

from tests.optim.models import assert_same_params, batches, make_models, train_step
from tierswap.optim import SwapOptimizer


def _recording(monkeypatch: pytest.MonkeyPatch, swap: SwapOptimizer) -> list[int]:
    """The slice indices the stepper's work runs, in order."""
    runner = swap._stepper.runner
    ran: list[int] = []
    work = runner.work

    def recording(plan, job, tensors, **kwargs):
        ran.append(job.name)
        return work(plan, job, tensors, **kwargs)

    monkeypatch.setattr(runner, "work", recording)
    return ran


def test_a_step_runs_each_slice_with_a_gradient_once(monkeypatch) -> None:
    plain_model, model = make_models()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    with SwapOptimizer(model.parameters(), lr=1e-2, host_budget="8KiB") as swap:
        ran = _recording(monkeypatch, swap)
        for x in batches(2):
            train_step(plain_model, plain, x)
            train_step(model, swap, x)
        assert_same_params(plain_model, model)
        unused = swap._layout.slot_of[id(model.unused)].index  # its grad stays None
        expected = [
            p.index for p in swap.slices if any(s.index != unused for s in p.slots)
        ]  # fmt: skip
        assert sorted(ran[: len(ran) // 2]) == sorted(expected)
        assert sorted(ran) == sorted(expected * 2)


def test_a_step_without_gradients_counts_and_runs_nothing(monkeypatch) -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters(), host_budget="8KiB", commit_every=0) as swap:
        ran = _recording(monkeypatch, swap)
        before = [p.detach().clone() for p in model.parameters()]
        swap.step()
        assert ran == []
        assert swap.steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_gradient_of_a_parameter_it_does_not_hold_is_ignored(monkeypatch) -> None:
    _, model = make_models()
    stranger = torch.nn.Parameter(torch.ones(3))
    with SwapOptimizer(model.parameters(), host_budget="8KiB", overlap=None) as swap:
        pipeline = swap._backend.pipeline
        prefetched: list[object] = []
        monkeypatch.setattr(pipeline, "prefetch", prefetched.extend)
        swap._stepper.grad_final(stranger)
        assert prefetched == []
        swap._stepper.grad_final(model.inp.weight)
        assert prefetched  # the reads of its slices start


def test_a_failed_slice_marks_the_state_and_releases_the_pipeline(tmp_path, monkeypatch) -> None:
    _, model = make_models()
    swap = SwapOptimizer(model.parameters(), swap_dir=tmp_path / "swap", host_budget="8KiB")
    train_step(model, swap, batches(1)[0])

    def broken(plan, job, tensors, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(swap._stepper.runner, "work", broken)
    model(batches(1)[0]).square().mean().backward()
    with pytest.raises(OSError, match="Input/output"):
        swap.step()
    assert swap._state.failed
    assert swap._state.plan is None
    assert swap.steps == 1
    assert swap.tier_stats()["host"]["used"] <= swap.host_budget
    swap.close()
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "swap", resume=True) as resumed:
        assert resumed.steps == 1  # the failed step left the last commit as it was
