"""The pipeline's work on the device, checked on the CPU with the recording stand-in of the
transfer layer: no work before its copies' events are waited for, no disk write before the
copy back has landed, the next job's copy issued while the current job works, and the device
ledger holding every job in flight there."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import tierswap as ts
from tests.engine.recording import (
    RecordingTransfers,
    copies_issued_ahead,
    ptrs_of,
    steps_after_their_copies,
    writes_after_landing,
)
from tierswap.errors import BudgetError
from tierswap.pipeline import Job, Pipeline, Region
from tierswap.tiers import DEVICE, HOST

CHUNK = 4096
NUMEL = 10 * 1024
JOB = 2 * CHUNK  # bytes of each job


class LoggedStore:
    """The store, with reads that are in before they return (so the next job's copy can be
    issued while the current one works) and each region write noted in the log."""

    def __init__(self, store: ts.SwapStore, transfers: RecordingTransfers) -> None:
        self._store = store
        self._transfers = transfers

    def info(self, key: str) -> Any:
        return self._store.info(key)

    def stats(self) -> dict[str, int]:
        return self._store.stats()

    def get_region_async(self, key: str, start: int, stop: int, out: Any = None) -> Future[Any]:
        future = self._store.get_region_async(key, start, stop, out=out)
        future.exception()
        return future

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        self._transfers.note("write", (tensor.data_ptr(),))
        return self._store.put_region_async(key, start, tensor)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ts.SwapStore]:
    with ts.SwapStore(tmp_path / "s", chunk_bytes=CHUNK) as store:
        store.put("a", torch.arange(100.0))
        store.put("b", -torch.arange(100.0))
        store.put("big", torch.arange(float(NUMEL)))
        yield store


@pytest.fixture
def recorder() -> Iterator[RecordingTransfers]:
    transfers = RecordingTransfers()
    yield transfers
    transfers.close()


def _jobs(tiers: dict[int, str] | None = None) -> list[Job]:
    """Five jobs: one of two small keys, four of two chunks each of the large key."""
    tiers = tiers or {}
    jobs = [Job("small", (Region("a", 0, 100), Region("b", 0, 100)), JOB, tier=tiers.get(0))]
    for i in range(4):
        reads = (Region("big", 2048 * i, 2048 * (i + 1)),)
        jobs.append(Job(i + 1, reads, JOB, tier=tiers.get(i + 1)))
    return jobs


def _doubling(recorder: RecordingTransfers):
    def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
        recorder.note("step", ptrs_of(tensors.values()))
        for tensor in tensors.values():
            assert not tensor.isnan().any(), "worked on a copy that had not arrived"
            tensor.mul_(2)
        recorder.note("stepped", ptrs_of(tensors.values()))
        return dict(tensors)

    return work


def _pipeline(store, recorder, *, device_jobs: int, host_jobs: int = 5) -> Pipeline:
    return Pipeline(
        LoggedStore(store, recorder),
        budget=host_jobs * JOB,
        device_budget=device_jobs * JOB,
        transfers=recorder,
        work_on_device=True,
    )


def _assert_big(store: ts.SwapStore, factor: int) -> None:
    """The jobs' part of the large key is ``factor`` times its start; the rest is untouched."""
    expected = torch.arange(float(NUMEL))
    expected[:8192] *= factor
    assert torch.equal(store.get("big"), expected)


def _assert_ordered(recorder: RecordingTransfers) -> None:
    assert steps_after_their_copies(recorder.log) == []
    assert writes_after_landing(recorder.log) == []


def test_streamed_jobs_copy_ahead_and_write_after_landing(store, recorder) -> None:
    # room for every job on the device: a copy ahead never waits for an earlier one to land
    pipeline = _pipeline(store, recorder, device_jobs=5)
    jobs = _jobs()
    pipeline.prefetch(jobs)
    pipeline.run(jobs, _doubling(recorder))
    pipeline.drain()
    _assert_ordered(recorder)
    assert copies_issued_ahead(recorder.log) == (4, 4)  # every job after the first
    kinds = recorder.kinds()
    assert kinds.count("h2d") == kinds.count("d2h") == 6  # six regions, each in and out
    assert kinds.count("write") == 6
    _assert_big(store, 2)
    assert torch.equal(store.get("b"), -2 * torch.arange(100.0))
    device = pipeline.stats().device
    assert device.used == 0  # every job's device bytes came back once it landed
    assert device.peak <= 5 * JOB
    assert device.bytes_in == device.bytes_out == 4 * 8192 + 4 * 200
    assert pipeline.held == 0


def test_a_device_with_room_for_one_job_works_without_overlap(store, recorder) -> None:
    pipeline = _pipeline(store, recorder, device_jobs=1)
    jobs = _jobs()
    pipeline.run(jobs, _doubling(recorder))
    pipeline.drain()
    _assert_ordered(recorder)
    assert copies_issued_ahead(recorder.log) == (0, 4)  # each copy waited for room
    _assert_big(store, 2)
    assert pipeline.stats().device.peak == JOB


def test_resident_jobs_stay_on_the_device_or_land_in_host_memory(store, recorder) -> None:
    pipeline = _pipeline(store, recorder, device_jobs=4)
    jobs = _jobs({0: HOST, 1: DEVICE})
    for _ in range(2):
        pipeline.run(jobs, _doubling(recorder))
    pipeline.drain()
    assert pipeline.resident_tier("small") == HOST
    assert pipeline.resident_tier(1) == DEVICE
    # the device-resident job moved in once; the host-resident one goes in and out each pass
    device_ptrs = {t.data_ptr() for t in pipeline.resident(1).values()}
    copied_in = [op for op in recorder.log if op.kind == "h2d" and op.ptrs[1] in device_ptrs]
    assert len(copied_in) == 1
    assert torch.equal(store.get("a"), torch.arange(100.0))  # resident: not written yet
    pipeline.flush()
    _assert_ordered(recorder)
    assert copies_issued_ahead(recorder.log)[0] >= 6  # all but the passes' first copies
    assert torch.equal(store.get("a"), 4 * torch.arange(100.0))
    _assert_big(store, 4)
    assert pipeline.stats().device.used == JOB  # the device-resident job
    pipeline.evict()
    assert pipeline.stats().device.used == 0
    assert pipeline.held == 0


def test_failing_work_gives_back_the_device_and_host_bytes(store, recorder) -> None:
    pipeline = _pipeline(store, recorder, device_jobs=2)

    def broken(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
        raise RuntimeError("work failed")

    jobs = _jobs()
    pipeline.prefetch(jobs)
    with pytest.raises(RuntimeError, match="work failed"):
        pipeline.run(jobs, broken)
    pipeline.release()  # the next job's copy, issued ahead, goes too
    assert pipeline.stats().device.used == 0
    assert pipeline.held == 0
    pipeline.run(jobs, _doubling(recorder))  # and the pipeline still works
    pipeline.drain()
    _assert_big(store, 2)


def test_a_device_without_room_for_a_job_is_refused(store, recorder) -> None:
    pipeline = _pipeline(store, recorder, device_jobs=0)
    with pytest.raises(BudgetError, match="device"):
        pipeline.run(_jobs()[1:2], _doubling(recorder))
    pipeline.release()
    assert pipeline.held == 0


def test_flushing_device_resident_jobs_counts_their_host_copies(store, recorder) -> None:
    """A device-resident job is written through host buffers reserved in the host ledger (the
    room one streamed job has), one job after another, given back once written."""
    pipeline = _pipeline(store, recorder, device_jobs=4, host_jobs=1)
    jobs = _jobs({1: DEVICE, 2: DEVICE, 3: DEVICE})[1:]
    pipeline.run(jobs, _doubling(recorder))
    pipeline.drain()
    before = pipeline.stats()
    held_at_copy: list[int] = []
    to_host = recorder.to_host

    def counted(device_tensor, host_tensor=None):
        held_at_copy.append(pipeline.held)  # the host bytes reserved when the copy starts
        return to_host(device_tensor, host_tensor)

    recorder.to_host = counted  # type: ignore[method-assign]
    pipeline.flush()
    after = pipeline.stats()
    assert (
        held_at_copy == [JOB] * 3
    )  # each device-resident job's copy has its room in the host ledger
    assert after.host.used == before.host.used  # the copies' buffers went back
    assert after.host.peak <= after.host.budget == JOB
    assert after.device.bytes_out - before.device.bytes_out == 3 * 2048 * 4
    _assert_big(store, 2)
    pipeline.evict()
    assert pipeline.held == 0
