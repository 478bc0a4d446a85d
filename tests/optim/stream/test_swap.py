"""A streamed parameter's values reach its device through the engine's transfer layer, as on a
GPU: memory allocated for uploads, copies on the upload stream that the compute stream waits
for. The recording stand-in of the transfer layer copies late (the target holds NaN until its
copy has run), so a module that used its parameters before their copy was waited for would
change the results: training stays bitwise torch's. (The stand-in's wait is the calling
thread's, so a host buffer reused before its copy has read it shows only on a GPU:
``bench/gpu_check.py``, check 11.)"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.recording import (
    RecordingTransfers,
    copies_issued_ahead,
    ptrs_of,
    steps_after_their_copies,
)
from tests.optim.models import assert_same_params, batch_for_step, make_models
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream import _storage, _stream, _swap
from tierswap.optim.stream._swap import landed
from tierswap.pipeline import Pipeline


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingTransfers]:
    """The stand-in as the transfer layer of the parameters' device."""
    recording = RecordingTransfers()
    monkeypatch.setattr(_swap, "transfers_for", lambda device: recording)
    monkeypatch.setattr(_storage, "transfers_for", lambda device: recording)  # allocations
    yield recording
    recording.close()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model(batch_for_step(step)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("host_budget", [20480, None], ids=["streamed", "resident"])
def test_values_reach_the_device_on_the_upload_stream(
    tmp_path: Path, transfers: RecordingTransfers, host_budget: int | None
) -> None:
    ref, model = make_models()
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path, host_budget=host_budget,
        offload_parameters=True,
    )  # fmt: skip
    with opt:
        for step in range(4):
            _train(ref, plain, step)
            _train(model, opt, step)
            assert_same_params(ref, model)  # model.parameters() reads each streamed value
        kinds = transfers.kinds()
    copies = kinds.count("h2d")
    assert copies > 0
    assert kinds.count("wait") == copies  # the compute stream waits for every copy
    assert kinds.count("upload_memory") == copies  # none waits for the compute stream
    assert kinds.count("allocating") >= copies  # each copy's target allocated for uploads
    if host_budget is None:  # resident slices: their copies come from host memory
        assert opt.placement


@pytest.mark.parametrize("host_budget", [20480, None], ids=["streamed", "resident"])
def test_the_next_modules_values_are_uploaded_while_the_one_before_runs(
    tmp_path: Path, transfers: RecordingTransfers, host_budget: int | None
) -> None:
    """Once the first iteration has recorded the order of uses, a module's parameters are
    copied to the device ahead of it: their copies are issued before the module before it
    ends (the kernels they hide behind), and the compute stream waits for them only when the
    module runs (the stand-in's copies land late, holding NaN until then: a module that used
    them unwaited would change the results). Bitwise torch's."""
    torch.manual_seed(0)  # every parameter trains: with room, every slice is resident
    ref = torch.nn.Sequential(
        torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
        torch.nn.Linear(24, 4),
    )  # fmt: skip
    model = copy.deepcopy(ref)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path, host_budget=host_budget,
        offload_parameters=True,
    )  # fmt: skip
    for module in model[::2]:  # after the optimizer's hooks: the module's compute
        module.register_forward_pre_hook(
            lambda m, _: transfers.note("step", ptrs_of(m.parameters()))
        )
        module.register_forward_hook(lambda *_: transfers.note("stepped"))
    with opt:
        for step in range(4):  # (reading the parameters between steps would keep them)
            _train(ref, plain, step)
            _train(model, opt, step)
        stats = opt.tier_stats()["parameters"]
    assert_same_params(ref, model)
    assert steps_after_their_copies(transfers.log) == []
    if host_budget is None:  # streamed through 20 KiB, a module whose reads ahead have not
        # landed by the hook of the module before is read at its own (timing: not counted)
        ahead, uses = copies_issued_ahead(transfers.log)
        assert stats["uploaded_ahead_bytes"] > 0
        # resident from the second step's pass on: the second and third layers in each of
        # the last two forwards (and in the one before, where their reads ahead had landed)
        assert ahead >= 4, (ahead, uses)


def test_an_upload_ahead_that_fails_falls_back_and_leaves_nothing_held(
    tmp_path: Path, transfers: RecordingTransfers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload ahead whose read fails (as a read started ahead that landed with an error)
    gives up: the reads of that module not yet lent are dropped, nothing stays lent, and the
    module's own use reads its values again. Bitwise torch's; the host budget holds as much
    after such a step as after one without."""
    ref, model = make_models()
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model, torch.optim.AdamW, lr=1e-2, swap_dir=tmp_path, host_budget=20480,
        offload_parameters=True,
    )  # fmt: skip
    pipeline = opt._backend.pipeline
    lend, failed = pipeline.lend, []

    def landed_soon(pipeline: Pipeline, layout: Any, slot: Any) -> bool:
        """As if the module before computed long enough for the reads ahead to land."""
        deadline = time.monotonic() + 0.2
        while not landed(pipeline, layout, slot) and time.monotonic() < deadline:
            time.sleep(0.001)
        return landed(pipeline, layout, slot)

    monkeypatch.setattr(_stream, "landed", landed_soon)

    def fail_once(job):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(job.name)
            pipeline.release([job.name])  # the failed read gave its buffers back
            raise OSError("read failed")
        return lend(job)

    with opt:
        for step in range(4):
            if step == 2:
                held = _settled(pipeline)
                monkeypatch.setattr(pipeline, "lend", fail_once)
            _train(ref, plain, step)
            _train(model, opt, step)
        assert failed  # an upload ahead was tried, and failed
        assert _settled(pipeline) == held
    assert_same_params(ref, model)


def _settled(pipeline: Pipeline) -> int:
    """The host bytes ``pipeline`` holds once its writes have landed and its reads started
    ahead are dropped: resident jobs, the work buffer, and what is lent."""
    pipeline.drain()
    pipeline.release()
    return pipeline.held
