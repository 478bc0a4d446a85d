"""The engine's transfer layer: the CPU pass-through, CUDA's side streams (on a GPU), the
recording stand-in the GPU path is tested with, and the device staging that keeps a front
end's work on the device within the device ledger."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.engine.recording import RecordingTransfers, steps_after_their_copies
from tierswap.engine import (
    CudaTransfers,
    DeviceStaging,
    Ledger,
    PassThrough,
    ToDevice,
    to_host_all,
    transfers_for,
)
from tierswap.errors import BudgetError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cpu_passes_tensors_through() -> None:
    transfers = transfers_for(torch.device("cpu"))
    assert isinstance(transfers, PassThrough)
    assert not transfers.moves
    host = torch.arange(6.0)
    copy = transfers.to_device(host)
    assert copy.done.done()
    assert transfers.ready(copy) is host
    same = transfers.to_host(host, host)
    assert same.host_tensor.data_ptr() == host.data_ptr()
    assert same.done.done()
    other = torch.zeros(6)
    moved = transfers.to_host(host * 2, other)  # a new result goes into the buffer to write
    assert moved.host_tensor is other
    assert torch.equal(other, 2 * torch.arange(6.0))
    assert transfers.to_host(host).host_tensor.data_ptr() == host.data_ptr()


def test_a_copy_back_casts_into_a_buffer_of_another_dtype_even_when_empty() -> None:
    """The buffer to write takes the stored array's dtype: a bf16 value goes into an fp32
    buffer cast, also when both are empty (empty tensors share the null data pointer)."""
    transfers = transfers_for(torch.device("cpu"))
    value = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    buffer = torch.empty(2)
    assert transfers.to_host(value, buffer).host_tensor is buffer
    assert torch.equal(buffer, torch.tensor([1.5, -2.0]))
    empty = transfers.to_host(torch.empty(0, dtype=torch.bfloat16), torch.empty(0))
    assert empty.host_tensor.dtype == torch.float32


def _transfers(kind: str):
    if kind == "cpu":
        return transfers_for(torch.device("cpu"))
    if kind == "stand-in":
        return RecordingTransfers(delay=0.001)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return transfers_for(torch.device("cuda"))


@pytest.mark.parametrize("kind", ["cpu", "stand-in", "cuda"])
def test_copies_of_a_stepped_parameter_work_with_grad_mode_on(kind: str) -> None:
    """A commit at ``close()`` runs with grad mode on and copies views of parameters that a
    step made under ``no_grad`` and then changed in place (torch refuses any recorded use of
    such a view). Copies both ways work there, and autograd records none of them."""
    transfers = _transfers(kind)
    device = transfers.device
    param = torch.nn.Parameter(torch.arange(8.0, device=device))
    with torch.no_grad():
        view = param.view(-1)[2:6]
        param.mul_(2)  # the step
    assert torch.is_grad_enabled()
    back = transfers.to_host(view, torch.zeros(4, dtype=torch.float64))
    back.done.result()
    assert back.host_tensor.grad_fn is None
    assert not back.host_tensor.requires_grad
    assert torch.equal(back.host_tensor, torch.tensor([4.0, 6.0, 8.0, 10.0], dtype=torch.float64))
    whole = transfers.to_host(view)  # a new buffer, or the view itself where nothing moves
    whole.done.result()
    assert not whole.host_tensor.requires_grad
    assert torch.equal(whole.host_tensor.cpu(), torch.tensor([4.0, 6.0, 8.0, 10.0]))
    into = transfers.to_device(torch.full((4,), -1.0), view)
    transfers.ready(into)
    into.done.result()
    assert param.grad_fn is None
    assert torch.equal(param.detach().cpu(), torch.tensor([0.0, 2.0, -1, -1, -1, -1, 12, 14]))
    if kind == "stand-in":
        transfers.close()


def test_the_stand_in_copies_late_and_logs_in_order() -> None:
    transfers = RecordingTransfers(delay=0.01)
    try:
        host = torch.arange(4.0)
        copy = transfers.to_device(host)
        assert copy.device_tensor.isnan().all()  # not arrived yet
        assert torch.equal(transfers.ready(copy), host)  # waited for
        back = transfers.to_host(copy.device_tensor * 3)
        back.done.result()
        assert torch.equal(back.host_tensor, 3 * host)
        assert transfers.kinds() == ["h2d", "h2d_done", "wait", "record", "d2h", "d2h_done"]
    finally:
        transfers.close()


def test_a_step_that_does_not_wait_for_its_copy_is_caught() -> None:
    """The negative control of the ordering checks: a ready() that forgets to wait."""

    class Careless(RecordingTransfers):
        def ready(self, copy: ToDevice) -> torch.Tensor:
            return copy.device_tensor

    transfers = Careless(delay=0.05)
    try:
        device_tensor = transfers.ready(transfers.to_device(torch.ones(4)))
        transfers.note("step", (device_tensor.data_ptr(),))
        assert device_tensor.isnan().all()  # the step would compute garbage
        assert steps_after_their_copies(transfers.log)
    finally:
        transfers.close()


def _staging(budget: int) -> tuple[DeviceStaging[str], Ledger, RecordingTransfers]:
    transfers = RecordingTransfers(delay=0.005)
    ledger = Ledger("device", budget, threading.Condition())
    return DeviceStaging(transfers, ledger), ledger, transfers


def test_staging_holds_device_bytes_until_the_results_land() -> None:
    staging, ledger, transfers = _staging(budget=64)
    try:
        host = {"a": torch.arange(8.0)}  # 32 bytes
        staged = staging.copy_in(32, host, wait=False)
        assert staged is not None
        assert ledger.used == 32
        staging.ahead("next", 32, host)
        assert ledger.used == 64
        assert staging.copy_in(32, host, wait=False) is None  # no room: not copied ahead
        device = staging.ready(staged)
        written, landed = to_host_all(transfers, {"a": torch.empty(8)}, {"a": device["a"] * 2})
        done = staging.finished(staged, landed, moved=32)
        # the next copy in waits for room: the results in flight will free it
        later = staging.copy_in(32, host, wait=True)
        assert done.done()
        assert torch.equal(written["a"], 2 * torch.arange(8.0))
        assert later is not None
        staging.abandon(later)
        staging.drop_all()
        assert ledger.used == 0
        assert ledger.bytes_in == 3 * 32
        assert ledger.bytes_out == 32
    finally:
        transfers.close()


def test_staging_refuses_what_can_never_fit() -> None:
    staging, _ledger, transfers = _staging(budget=16)
    try:
        with pytest.raises(BudgetError, match="device"):
            staging.copy_in(32, {"a": torch.arange(8.0)}, wait=True)
        staging.copy_in(16, {"a": torch.arange(4.0)}, wait=False)
        with pytest.raises(BudgetError, match="nothing in flight"):
            staging.copy_in(16, {"a": torch.arange(4.0)}, wait=True)
    finally:
        transfers.close()


def test_results_landing_in_host_tensors_are_waited_for() -> None:
    staging, _ledger, transfers = _staging(budget=64)
    try:
        resident = {"a": torch.zeros(4)}
        staged = staging.copy_in(16, resident, wait=False)
        assert staged is not None
        device = staging.ready(staged)
        host, landed = to_host_all(transfers, resident, {"a": device["a"] + 5})
        assert host["a"] is resident["a"]
        staging.land("job", staging.finished(staged, landed, moved=16))
        assert not staging.landed("job")
        staging.wait_landing("job")
        assert staging.landed("job")
        assert torch.equal(resident["a"], torch.full((4,), 5.0))
    finally:
        transfers.close()


@cuda
def test_cuda_copies_round_trip_on_side_streams() -> None:
    transfers = transfers_for(torch.device("cuda"))
    assert isinstance(transfers, CudaTransfers)
    assert transfers_for(torch.device("cuda")) is transfers  # one per GPU
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    copy = transfers.to_device(host)
    device_tensor = transfers.ready(copy)
    result = device_tensor * 2  # on the compute stream, after the copy's event
    back = transfers.to_host(result)
    back.done.result()  # the wait happens here, where the bytes are needed
    assert back.host_tensor.is_pinned()
    assert torch.equal(back.host_tensor, 2 * host)
    copy.done.result()


@cuda
def test_cuda_copy_into_upload_memory_lands_before_the_compute_stream_reads_it() -> None:
    transfers = transfers_for(torch.device("cuda"))
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # the compute stream has work queued: the copy need not wait for it
        busy = busy @ busy / 4096
    with transfers.allocating():
        target = torch.empty(1 << 20, device="cuda")
    copy = transfers.to_device(host, target, upload_memory=True)
    result = transfers.ready(copy) + 1  # on the compute stream, after the copy's event
    copy.done.result()
    assert torch.equal(result.cpu(), host + 1)
