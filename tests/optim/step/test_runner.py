"""The slice runner (``tierswap.optim.step._runner``): a speculative run changes no parameter
before the copy it would be rolled back to is on disk."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tests.optim.models import assert_same_params, batches, make_models, settled_step, train_step
from tierswap.errors import FailedStepError
from tierswap.optim import SwapOptimizer
from tierswap.optim.step import _runner


def test_a_slice_whose_pre_step_copy_fails_to_write_does_not_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculating, each slice's work waits for the write of its parameters' pre-step values
    (fp32 parameters: the store keeps them, no master) before it steps them. When those writes
    fail, no speculative slice steps, the failure is raised (here by ``synchronize()``), the
    parameters keep their values, and the step is not committed; the next step (writes
    working again) is bitwise torch's."""
    ref_model, model = make_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path / "s",
        host_budget="48KiB", commit_every=1,
    )  # fmt: skip
    xs = batches(3)
    for x in xs[:2]:
        train_step(ref_model, ref, x)
        settled_step(model, opt, x)  # every slice with state speculates (a GPU's backward)
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
    model(xs[2]).float().square().mean().backward()
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
    train_step(ref_model, ref, xs[2])
    settled_step(model, resumed, xs[2])
    resumed.close()
    assert_same_params(ref_model, model)
