"""The optimizer's GPU path, checked on the CPU: the recording stand-in of the transfer layer
takes the place of CUDA's, so every slice steps on "device" copies that arrive late (NaN until
their copy has run) and land back late. The order of copies, events, steps and disk writes is
checked from its log, and the results stay bitwise equal to torch."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tests.engine.recording import (
    RecordingTransfers,
    copies_issued_ahead,
    ptrs_of,
    steps_after_their_copies,
    writes_after_landing,
)
from tests.optim.models import assert_same_params, assert_same_state
from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer, _assembly
from tierswap.optim.plan import _layout
from tierswap.store import SwapStore

LAYERS = 6
WIDTH = 48
STATE = LAYERS * (WIDTH * WIDTH + WIDTH) * 8  # AdamW's two fp32 moments
PLACEMENTS = {
    # name: (host_budget, device_budget)
    "streamed through the device": ("64KiB", "48KiB"),
    "device + host + nvme": (STATE // 2, STATE // 2),
    "all device": ("64KiB", 3 * STATE),
    # the slices' working sets take 192 KiB in whole pages, and the work one more slice's
    # (16 KiB; the pipeline keeps that free): no room for three streamed slices too
    "the device holds the state": ("64KiB", "216KiB"),
}


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _install(monkeypatch, transfers: RecordingTransfers, *, sync_writes: bool = False) -> None:
    """``transfers`` as the optimizer's transfer layer; reads that are in when they return
    (so a slice's copy can go ahead while the one before steps); disk writes logged (and
    finished before they return with ``sync_writes``)."""
    monkeypatch.setattr(_layout, "STREAM_FLOOR", 16 << 10)  # KiB budgets stream a tenth
    monkeypatch.setattr(_assembly, "transfers_for", lambda device: transfers)
    get, put = SwapStore.get_region_async, SwapStore.put_region_async

    def read_now(self, key: str, start: int, stop: int, out: Any = None) -> Future[Any]:
        future = get(self, key, start, stop, out=out)
        future.exception()
        return future

    def logged_put(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        transfers.note("write", (tensor.data_ptr(),))
        future = put(self, key, start, tensor)
        if sync_writes:
            future.exception()
        return future

    monkeypatch.setattr(SwapStore, "get_region_async", read_now)
    monkeypatch.setattr(SwapStore, "put_region_async", logged_put)


@pytest.fixture
def recorder(monkeypatch) -> Iterator[RecordingTransfers]:
    """The stand-in, copying late, as the optimizer's transfer layer."""
    transfers = RecordingTransfers()
    _install(monkeypatch, transfers)
    yield transfers
    transfers.close()


@pytest.fixture
def bare_recorder(monkeypatch) -> Iterator[RecordingTransfers]:
    """The stand-in, copying at once, as the optimizer's transfer layer, and nothing else
    patched: the layout's own streaming floor, the store's own reads and writes."""
    transfers = RecordingTransfers(delay=None)
    monkeypatch.setattr(_assembly, "transfers_for", lambda device: transfers)
    yield transfers
    transfers.close()


def logged(recorder: RecordingTransfers) -> type[torch.optim.AdamW]:
    """AdamW whose steps note, before and after, the tensors they update."""

    class LoggedAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            tensors = [p for group in self.param_groups for p in group["params"]]
            tensors += [
                value
                for state in self.state.values()
                for value in state.values()
                if torch.is_tensor(value) and value.dim() > 0
            ]
            recorder.note("step", ptrs_of(tensors))
            loss = super().step(closure)
            recorder.note("stepped", ptrs_of(tensors))
            return loss

    return LoggedAdamW


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, WIDTH, generator=gen)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_device_path_is_ordered_and_bitwise(placement, recorder, tmp_path) -> None:
    host, device = PLACEMENTS[placement]
    torch.manual_seed(0)
    ref_model, model = Stack(), Stack()
    model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model.parameters(), logged(recorder), lr=1e-2, swap_dir=tmp_path / "run",
        host_budget=host, device_budget=device, commit_every=2,
    )  # fmt: skip
    with opt:
        _run(ref_model, ref)
        _run(model, opt)
        opt.synchronize()
        assert_same_params(ref_model, model)
        assert_same_state(ref.state_dict(), opt.state_dict())
        stats = opt.tier_stats()
        assert 0 <= stats["device"]["used"] <= stats["device"]["budget"]
        # the device tensors of the copies in never outlive their bytes in the device ledger
        # (a GPU could not give their memory to the next slice's copies)
        assert recorder.peak_device_bytes <= stats["device"]["peak"]
    log = recorder.log
    assert steps_after_their_copies(log) == []
    assert writes_after_landing(log) == []
    kinds = recorder.kinds()
    if placement in ("all device", "the device holds the state"):
        # the first step made the state there: nothing moves in
        assert set(opt.placement.values()) == {"device"}
        assert len(opt.placement) == len(opt.slices)
        assert "h2d" not in kinds
        assert kinds.count("d2h") > 0  # commits copy the state back to write it
        assert kinds.count("write") > 0
    else:
        assert kinds.count("wait") == kinds.count("h2d") > 0
        assert kinds.count("d2h") > 0
        assert kinds.count("write") > 0
        assert copies_issued_ahead(log)[0] > 0  # how many depends on the copies' speed


def test_each_slice_is_copied_in_while_the_one_before_steps(monkeypatch, tmp_path) -> None:
    """With copies and disk I/O that keep up (the stand-in copies at once, the store's reads
    and writes finish before they return), the copy of every slice but the first of each
    step is issued before the slice ahead of it has finished stepping."""
    transfers = RecordingTransfers(delay=None)
    _install(monkeypatch, transfers, sync_writes=True)
    torch.manual_seed(0)
    model = Stack()
    # overlap=None: one run of every slice (speculation runs a few at a time, as they get ready)
    opt = SwapOptimizer(
        model.parameters(), logged(transfers), lr=1e-2, swap_dir=tmp_path / "run",
        host_budget="64KiB", device_budget="48KiB", policy="lru", overlap=None,
    )  # fmt: skip
    with opt:
        assert not opt.placement  # LRU keeps nothing of a cycle larger than a tier
        _run(model, opt, steps=3)
    ahead, total = copies_issued_ahead(transfers.log)
    assert total == 2 * len(opt.slices)  # steps 2 and 3 (the first made the state)
    assert ahead == total - 2  # all but the first slice of each step
    assert steps_after_their_copies(transfers.log) == []
    assert writes_after_landing(transfers.log) == []
    transfers.close()


def test_master_weights_step_on_the_device_copies(recorder, tmp_path) -> None:
    """bf16 parameters: their fp32 masters are read, copied in, stepped, copied back and
    written; the parameters equal a reference that steps fp32 masters in memory."""
    torch.manual_seed(0)
    ref_model = Stack().to(torch.bfloat16)
    model = copy.deepcopy(ref_model)
    masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    opt = SwapOptimizer(
        model.parameters(), logged(recorder), lr=1e-2, swap_dir=tmp_path / "run",
        host_budget="96KiB", device_budget="64KiB",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    with opt:
        assert all(seg.slot.has_master for piece in opt.slices for seg in piece.segments)
        for _ in range(3):
            x = torch.randn(16, WIDTH, generator=gen).to(torch.bfloat16)
            ref_model.zero_grad()
            ref_model(x).float().square().mean().backward()
            for master, param in zip(masters, ref_model.parameters(), strict=True):
                master.grad = param.grad.float()
            ref.step()
            with torch.no_grad():
                for master, param in zip(masters, ref_model.parameters(), strict=True):
                    param.copy_(master)
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        opt.synchronize()
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
    assert steps_after_their_copies(recorder.log) == []
    assert writes_after_landing(recorder.log) == []
    # masters are the step's targets: each step waited for its master's copy
    assert recorder.kinds().count("wait") >= 3 * len(opt.slices)


def test_a_device_budget_below_a_slice_is_refused_when_slices_step_there(recorder) -> None:
    """Streamed slices pass through the device: its budget must hold one (checked on a GPU by
    tests/optim/test_errors.py; here through the stand-in)."""
    model = torch.nn.Linear(128, 64)
    with pytest.raises(ConfigError, match="device_budget"):
        SwapOptimizer(model.parameters(), host_budget="1MiB", device_budget="1KiB")


def test_a_commit_writes_device_resident_slices_larger_than_the_host_budget(
    bare_recorder, tmp_path
) -> None:
    """A GPU's budget may exceed the host's: a commit writes each slice resident on the device
    through host buffers of the host budget, a region at a time, never the whole slice at once
    (which may not fit there), and with grad mode on at ``close()``."""
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    model = copy.deepcopy(ref_model)
    state = 8 * sum(p.numel() for p in model.parameters())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = SwapOptimizer(
        model.parameters(), lr=1e-2, swap_dir=tmp_path / "run", host_budget=state // 4,
        device_budget=state, commit_every=2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    with opt:
        assert "device" in opt.placement.values()
        for _ in range(3):  # the third step is committed by close()
            x = torch.randn(16, 512, generator=gen)
            for m, o in ((ref_model, ref), (model, opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
    resumed_model = copy.deepcopy(ref_model)
    with SwapOptimizer(
        resumed_model.parameters(), lr=1e-2, swap_dir=tmp_path / "run", resume=True,
        host_budget=state // 4, device_budget=state,
    ) as resumed:  # fmt: skip
        assert resumed.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
        assert_same_state(ref.state_dict(), resumed.state_dict())
    assert_same_params(ref_model, model)


def test_a_slice_copied_in_never_outlives_its_bytes_in_the_device_ledger(
    bare_recorder, tmp_path
) -> None:
    """Slices streamed through a device budget of two: the device tensors of a slice's copies
    go when the ledger gives their bytes to the next slice (a GPU could not reuse memory that
    is still referenced: its real peak would pass the budget)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    state = 8 * sum(p.numel() for p in model.parameters())
    opt = SwapOptimizer(
        model.parameters(), lr=1e-2, swap_dir=tmp_path / "run", host_budget=state // 4,
        device_budget=state // 4, durable=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    with opt:
        assert not opt.placement  # every slice is copied in and out each step
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 256, generator=gen)).square().mean().backward()
            opt.step()
        opt.synchronize()
        ledger_peak = opt.tier_stats()["device"]["peak"]
    assert 0 < bare_recorder.peak_device_bytes <= ledger_peak
