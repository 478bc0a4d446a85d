"""The slice runner (``tierswap.optim.step._runner``): a speculative run changes no parameter
before the copy it would be rolled back to is on disk."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tests.optim.models import assert_same_params
from tierswap.errors import FailedStepError
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _runner


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _step(model: Stack, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    if isinstance(opt, SwapOptimizer):
        opt._stepper.deferred.wait()  # every slice with state speculates (a GPU's backward)
    opt.step()


def test_a_slice_whose_pre_step_copy_fails_to_write_does_not_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculating, each slice's work waits for the write of its parameters' pre-step values
    (fp32 parameters: the store keeps them, no master) before it steps them. When those writes
    fail, no speculative slice steps, the failure is raised (here by ``synchronize()``), the
    parameters keep their values, and the step is not committed; the next step (writes
    working again) is bitwise torch's."""
    ref_model, model = Stack(), Stack()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "s",
        host_budget="48KiB", commit_every=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 48, generator=gen) for _ in range(3)]
    for x in xs[:2]:
        _step(ref_model, ref, x)
        _step(model, opt, x)
    saved = [p.detach().clone() for p in model.parameters()]
    backend = opt._parts.backend
    real_put, real_step = backend.put_regions_async, _runner.step_slice
    stepped: list[int] = []

    def failing_put(writes: Any) -> Future[Any]:
        failed: Future[Any] = Future()
        failed.set_exception(OSError(5, "injected: the pre-step copy was not written"))
        return failed

    def recording_step(plan: Any, piece: Any, *args: Any) -> Any:
        stepped.append(piece.index)
        return real_step(plan, piece, *args)

    monkeypatch.setattr(backend, "put_regions_async", failing_put)
    monkeypatch.setattr(_runner, "step_slice", recording_step)
    opt.zero_grad()
    model(xs[2]).square().mean().backward()
    with pytest.raises(OSError, match="injected"):
        opt.synchronize()  # waits for the worker's speculative slices, raises their failure
    assert stepped == []  # no slice reached its step
    for before, now in zip(saved, model.parameters(), strict=True):
        assert torch.equal(before, now)
    with pytest.raises(FailedStepError):
        opt.commit()
    monkeypatch.setattr(backend, "put_regions_async", real_put)
    opt.close()
    resumed = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "s",
        host_budget="48KiB", resume=True,
    )  # fmt: skip
    assert resumed.steps == 2  # the failed step was not committed
    _step(ref_model, ref, xs[2])
    _step(model, resumed, xs[2])
    resumed.close()
    assert_same_params(ref_model, model)
