"""Hypothesis state machine: the pipeline (the engine's cyclic front end) against a dict model.

Passes over random jobs (streamed, or resident in the device or host tier), prefetches,
releases, flushes and evictions, with reads and writes delayed or failing at random, must keep
the ledgers within their budgets at every step, give the work of every job the value the model
says, write each job's value, and leave the store holding what the model says once a flush has
run. The comparisons go on after a failure: a region whose write failed may hold the value
before or the value written (the model keeps both until the next write of it), every other
region one value. Each injected write failure is raised exactly once; after ``release()`` and
``drain()`` the pipeline holds its host-resident jobs' bytes, no more. A second machine runs
the same rules with the work on the device: the recording stand-in of the transfer layer copies
every job in and out late, and no work may use a copy before waiting for it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.engine.recording import RecordingTransfers, ptrs_of, steps_after_their_copies
from tests.machines import FlakyStore, InjectedFault, threaded_settings
from tierswap import SwapStore
from tierswap.errors import BudgetError
from tierswap.pipeline import Job, Pipeline, Region

CHUNK = 4096
KEYS = ("a", "b")
NUMEL = 4 * CHUNK // 4  # four chunks of float32 per key
JOB_BYTES = CHUNK  # each job reads one chunk of one key


def _job(index: int, tier: str | None) -> Job:
    key, chunk = KEYS[index % 2], index // 2
    start = chunk * (CHUNK // 4)
    return Job(index, (Region(key, start, start + CHUNK // 4),), JOB_BYTES, tier=tier)


def _one_of(got: torch.Tensor, candidates: list[torch.Tensor]) -> bool:
    return any(torch.equal(got, c) for c in candidates)


class PipelineMachine(RuleBasedStateMachine):
    """A pipeline over a :class:`FlakyStore`, one caller, against a model of each job's region:
    ``value`` (what the job's data is now: the last result of its work) and ``stored`` (what
    the store may hold: one value, or, after a failed write, the value before and the value
    written). The store's log of writes drives ``stored``; each write must carry the job's
    ``value``."""

    ON_DEVICE = False  # the work gets device copies (through the recording stand-in)

    def __init__(self) -> None:
        super().__init__()
        self.transfers = RecordingTransfers(delay=0.0005) if self.ON_DEVICE else None
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-pipe-sm-"))
        self.inner = SwapStore(self.dir / "s", mode="w", durable=False, chunk_bytes=CHUNK)
        initial = {key: torch.arange(NUMEL, dtype=torch.float32) * (i + 1) for i, key in
                   enumerate(KEYS)}  # fmt: skip
        for key, value in initial.items():
            self.inner.put(key, value)
        self.store = FlakyStore(self.inner)
        self.value: dict[int, torch.Tensor] = {}
        self.stored: dict[int, list[torch.Tensor]] = {}
        for index in range(8):
            region = _job(index, None).reads[0]
            self.value[index] = initial[region.key][region.start : region.stop].clone()
            self.stored[index] = [self.value[index]]
        self.seen = 0  # puts of the store's log applied to ``stored``
        self.reported: set[int] = set()  # ids of the injected faults the pipeline raised

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

    # ------------------------------------------------------------ the model
    def _index(self, key: str, start: int) -> int:
        return (start // (CHUNK // 4)) * 2 + KEYS.index(key)

    def _apply_puts(self) -> None:
        """Apply the store's new writes to ``stored``: each carries its job's value; a failed
        one may or may not have landed, so the region may hold the value before or this one."""
        for put in self.store.puts[self.seen :]:
            self.seen += 1
            index = self._index(put.key, put.start)
            assert torch.equal(put.data, self.value[index]), f"job {index} wrote another value"
            if put.fault is None:
                self.stored[index] = [put.data]
            else:
                event("a region may hold either value (a failed write)")
                self.stored[index] = [*self.stored[index], put.data]

    def _report(self, exc: OSError) -> None:
        """The pipeline raised ``exc``: an injected fault, fired, and raised once."""
        if not isinstance(exc, InjectedFault):
            raise exc
        assert any(exc is fault for fault in self.store.fired), exc
        assert id(exc) not in self.reported, f"{exc} was raised twice"
        self.reported.add(id(exc))

    def _unreported_writes(self) -> list[InjectedFault]:
        return [f for f in self.store.fired if f.kind == "write" and id(f) not in self.reported]

    def _compare_store(self) -> None:
        """Every write has ended: the store holds one of each region's values, and each job's
        value reached the store unless a write of it failed."""
        self._apply_puts()
        for index, candidates in self.stored.items():
            region = _job(index, None).reads[0]
            got = self.inner.get_region(region.key, region.start, region.stop)
            assert _one_of(got, candidates), f"job {index}'s region holds none of its values"
            assert _one_of(self.value[index], candidates), f"job {index}'s value was not written"

    # ------------------------------------------------------------ rules
    @rule(data=st.data(), step=st.floats(-3, 3, allow_nan=False))
    def run(self, data: st.DataObject, step: float) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.jobs), min_size=1, max_size=8,
                                    unique_by=lambda j: j.name))  # fmt: skip

        def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
            if self.transfers is not None:
                self.transfers.note("step", ptrs_of(tensors.values()))
            self._apply_puts()  # the writes before this job's read
            (got,) = tensors.values()
            if self.pipeline.resident_tier(job.name) is not None:  # kept from its last pass
                assert torch.equal(got.cpu(), self.value[job.name]), f"job {job.name} changed"
            else:  # read from the store
                assert _one_of(got.cpu(), self.stored[job.name]), f"job {job.name} misread"
            for tensor in tensors.values():
                tensor.add_(step)
            self.value[job.name] = got.cpu().clone()
            return dict(tensors)

        try:
            self.pipeline.run(chosen, work)
        except BudgetError as exc:  # never: one streamed job always fits beside the residents
            raise AssertionError(exc) from exc
        except OSError as exc:  # a failed read or write-behind: the pass stopped part way
            self._report(exc)
            self.pipeline.release()

    @rule(count=st.integers(1, 8))
    def prefetch(self, count: int) -> None:
        self.pipeline.prefetch(self.jobs[:count])

    @rule()
    def release_and_drain(self) -> None:
        """Once reads ahead are dropped and writes drained, the pipeline holds the bytes of
        its host-resident jobs, no more."""
        self.pipeline.release()
        try:
            self.pipeline.drain()
        except OSError as exc:
            self._report(exc)
        resident = [j for j in self.jobs if self.pipeline.resident_tier(j.name) == "host"]
        assert self.pipeline.held == sum(j.nbytes for j in resident)

    @rule(delay=st.sampled_from([0.0, 0.0, 0.002]))
    def slow_disk(self, delay: float) -> None:
        self.store.delay = delay

    @rule(late=st.booleans())
    def fail_a_write(self, late: bool) -> None:
        """Arm the next write's failure; one at a time (the pipeline raises the first of
        several): then each is raised exactly once."""
        if self.store.write_fault is None and not self._unreported_writes():
            self.store.arm("write", "late" if late else "fail")

    @rule()
    def fail_a_read(self) -> None:
        self.store.arm("read", "fail")

    @rule()
    def flush_and_compare(self) -> None:
        self.store.write_fault = None
        try:
            self.pipeline.flush()
        except OSError as exc:
            self._report(exc)
            return
        assert not self._unreported_writes(), "a failed write was never raised"
        self._compare_store()

    @rule()
    def evict(self) -> None:
        self.store.write_fault = None
        try:
            self.pipeline.evict()
        except OSError as exc:
            self._report(exc)

    @invariant()
    def ledgers_hold(self) -> None:
        stats = self.pipeline.stats()
        for tier in (stats.device, stats.host):
            assert 0 <= tier.used <= tier.budget
            assert tier.peak <= tier.budget

    def teardown(self) -> None:
        try:
            self.store.write_fault = None
            self.pipeline.release()
            try:  # every resident job is written: its writes all start, whichever fails
                self.pipeline.flush()
            except OSError as exc:
                self._report(exc)
            assert not self._unreported_writes(), "a failed write was never raised"
            self._compare_store()
        finally:
            self.store.close()
            self.inner.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.transfers is not None:
                self.transfers.close()
        if self.transfers is not None:
            assert steps_after_their_copies(self.transfers.log) == []


PipelineMachine.TestCase.settings = threaded_settings(max_examples=25, steps=15)
DEEP = settings(PipelineMachine.TestCase.settings, max_examples=150, stateful_step_count=40)
TestPipelineMachine = PipelineMachine.TestCase


@pytest.mark.slow
class TestPipelineMachineDeep(PipelineMachine.TestCase):
    """At the cache fault machine's depth (run with -m slow)."""

    settings = DEEP


class DeviceWorkMachine(PipelineMachine):
    ON_DEVICE = True


DeviceWorkMachine.TestCase.settings = PipelineMachine.TestCase.settings
TestDeviceWorkMachine = DeviceWorkMachine.TestCase


@pytest.mark.slow
class TestDeviceWorkMachineDeep(DeviceWorkMachine.TestCase):
    """At the cache fault machine's depth (run with -m slow)."""

    settings = DEEP
