"""Hypothesis state machine: the pipeline (the engine's cyclic front end) against a dict model.

Passes over random jobs (streamed, or resident in the device or host tier), prefetches,
releases, flushes and evictions, with reads and writes delayed or failing at random, must keep
the ledgers within their budgets at every step and leave the store holding what the model says
once a flush has run. A second machine runs the same rules with the work on the device: the
recording stand-in of the transfer layer copies every job in and out late, and no work may
use a copy before waiting for it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.engine.recording import RecordingTransfers, ptrs_of, steps_after_their_copies
from tierswap import SwapStore
from tierswap.errors import BudgetError
from tierswap.pipeline import Job, Pipeline, Region

CHUNK = 4096
KEYS = ("a", "b")
NUMEL = 4 * CHUNK // 4  # four chunks of float32 per key
JOB_BYTES = CHUNK  # each job reads one chunk of one key


class FlakyStore:
    """A store whose region I/O can be slowed, or made to fail, call by call."""

    def __init__(self, inner: SwapStore) -> None:
        self.inner = inner
        self.fail_next_write = False
        self.fail_next_read = False
        self.delay = 0.0
        self.writes_failed = 0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="flaky-store")

    def info(self, key: str) -> Any:
        return self.inner.info(key)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def get_region_async(self, key: str, start: int, stop: int, out: Any = None) -> Future[Any]:
        if self.fail_next_read:
            self.fail_next_read = False
            return _failed(OSError(5, "injected read failure"))
        return self._later(lambda: self.inner.get_region(key, start, stop, out=out))

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        if self.fail_next_write:
            self.fail_next_write = False
            self.writes_failed += 1
            return _failed(OSError(28, "injected write failure"))
        data = tensor.clone()  # the model's view: what this write will leave in the store
        return self._later(lambda: self.inner.put_region(key, start, data))

    def _later(self, call: Any) -> Future[Any]:
        """``call()`` after the delay, on the store's one worker: in the order the calls were
        made, as the real store orders a read after the writes started before it (a thread per
        call would let a read overtake the write it must see)."""

        def run() -> Any:
            time.sleep(self.delay)
            return call()

        return self._worker.submit(run)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def _job(index: int, tier: str | None) -> Job:
    key, chunk = KEYS[index % 2], index // 2
    start = chunk * (CHUNK // 4)
    return Job(index, (Region(key, start, start + CHUNK // 4),), JOB_BYTES, tier=tier)


class PipelineMachine(RuleBasedStateMachine):
    ON_DEVICE = False  # the work gets device copies (through the recording stand-in)

    def __init__(self) -> None:
        super().__init__()
        self.transfers = RecordingTransfers(delay=0.0005) if self.ON_DEVICE else None
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-pipe-sm-"))
        self.inner = SwapStore(self.dir / "s", mode="w", durable=False, chunk_bytes=CHUNK)
        self.model = {key: torch.arange(NUMEL, dtype=torch.float32) * (i + 1) for i, key in
                      enumerate(KEYS)}  # fmt: skip
        for key, value in self.model.items():
            self.inner.put(key, value)
        self.store = FlakyStore(self.inner)
        self.lost = False  # a write failed: the store may hold less than the model

    @initialize(
        host_jobs=st.integers(1, 4),
        device_jobs=st.integers(0, 2),
        tiers=st.lists(st.sampled_from([None, None, "host", "device"]), min_size=8, max_size=8),
    )
    def start(self, host_jobs: int, device_jobs: int, tiers: list[str | None]) -> None:
        # jobs resident in host memory leave room for one streamed job, as the optimizer's
        # placement does; device-tier jobs that find no room stream
        allowed = host_jobs - 1
        for i, tier in enumerate(tiers):
            if tier == "host":
                tiers[i] = "host" if allowed > 0 else None
                allowed -= 1
        self.pipeline = Pipeline(
            self.store,
            budget=host_jobs * JOB_BYTES,
            # on the device, room for the work of one streamed job beside the resident ones
            device_budget=(device_jobs + self.ON_DEVICE) * JOB_BYTES,
            transfers=self.transfers,
            work_on_device=self.ON_DEVICE,
        )
        self.jobs = [_job(i, tier) for i, tier in enumerate(tiers)]

    @rule(data=st.data(), step=st.floats(-3, 3, allow_nan=False))
    def run(self, data: st.DataObject, step: float) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.jobs), min_size=1, max_size=8,
                                    unique_by=lambda j: j.name))  # fmt: skip

        def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
            if self.transfers is not None:
                self.transfers.note("step", ptrs_of(tensors.values()))
            for region, tensor in tensors.items():
                tensor.add_(step)
                self.model[region.key][region.start : region.stop] += step
            return dict(tensors)

        try:
            self.pipeline.run(chosen, work)
        except BudgetError as exc:  # never: one streamed job always fits beside the residents
            raise AssertionError(exc) from exc
        except OSError:
            self.pipeline.release()
            self.lost = True  # a failed read or write-behind: the pass stopped part way

    @rule(count=st.integers(1, 8))
    def prefetch(self, count: int) -> None:
        self.pipeline.prefetch(self.jobs[:count])

    @rule()
    def release(self) -> None:
        self.pipeline.release()

    @rule(delay=st.sampled_from([0.0, 0.0, 0.002]))
    def slow_disk(self, delay: float) -> None:
        self.store.delay = delay

    @rule()
    def fail_a_write(self) -> None:
        self.store.fail_next_write = True

    @rule()
    def fail_a_read(self) -> None:
        self.store.fail_next_read = True

    @rule()
    def flush_and_compare(self) -> None:
        self.store.fail_next_write = False
        try:
            self.pipeline.flush()
        except OSError:
            self.lost = True
            return
        if not self.lost:
            for key, value in self.model.items():
                assert torch.equal(self.inner.get(key), value), key

    @rule()
    def evict(self) -> None:
        self.store.fail_next_write = False
        try:
            self.pipeline.evict()
        except OSError:
            self.lost = True

    @invariant()
    def ledgers_hold(self) -> None:
        for stats in self.pipeline.tier_stats().values():
            assert 0 <= stats.used <= stats.budget
            assert stats.peak <= stats.budget

    def teardown(self) -> None:
        try:
            self.pipeline.release()
            self.pipeline.drain()
        except OSError:
            pass
        self.store.close()
        self.inner.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.transfers is not None:
            self.transfers.close()
            assert steps_after_their_copies(self.transfers.log) == []


PipelineMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPipelineMachine = PipelineMachine.TestCase


class DeviceWorkMachine(PipelineMachine):
    ON_DEVICE = True


DeviceWorkMachine.TestCase.settings = PipelineMachine.TestCase.settings
TestDeviceWorkMachine = DeviceWorkMachine.TestCase
