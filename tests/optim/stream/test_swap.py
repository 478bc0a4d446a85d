"""A streamed parameter's values reach its device through the engine's transfer layer, as on a
GPU: memory allocated for uploads, copies on the upload stream that the compute stream waits
for. The recording stand-in of the transfer layer copies late (the target holds NaN until its
copy has run), so a module that used its parameters before their copy was waited for would
change the results: training stays bitwise torch's. (The stand-in's wait is the calling
thread's, so a host buffer reused before its copy has read it shows only on a GPU:
``bench/gpu_check.py``, check 11.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.recording import RecordingTransfers
from tests.optim.models import TinyNet, assert_same_params, batch_for_step, make_models
from tierswap.optim import SwapOptimizer
from tierswap.optim.stream import _swap


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingTransfers]:
    """The stand-in as the transfer layer of the parameters' device."""
    recording = RecordingTransfers()
    monkeypatch.setattr(_swap, "transfers_for", lambda device: recording)
    yield recording
    recording.close()


def _train(model: TinyNet, opt: torch.optim.Optimizer, step: int) -> None:
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
