"""The streaming pipeline: read-ahead / work / write-behind within a byte budget."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.errors import BudgetError, OutOfSpaceError
from tierswap.pipeline import Job, Pipeline, Region

CHUNK = 4096
NUMEL = 10 * 1024  # ten chunks of float32


def _jobs(resident: frozenset[int] = frozenset()) -> list[Job]:
    """Five jobs: one of two small keys, and four of two chunks each of the large key."""
    jobs = [Job("small", (Region("a", 0, 100), Region("b", 0, 100)), 2 * CHUNK, 0 in resident)]
    for i in range(4):
        reads = (Region("big", 2048 * i, 2048 * (i + 1)),)
        jobs.append(Job(i + 1, reads, 2 * CHUNK, i + 1 in resident))
    return jobs


def _double(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
    for tensor in tensors.values():
        tensor.mul_(2)
    return dict(tensors)


class FullDisk:
    """A store whose region writes fail as on a full disk."""

    def __init__(self, store: ts.SwapStore) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def put_region_async(self, key, start, tensor) -> Future[None]:
        failed: Future[None] = Future()
        failed.set_exception(OutOfSpaceError("disk full"))
        return failed


@pytest.fixture
def store(tmp_path: Path):
    with ts.SwapStore(tmp_path / "s", chunk_bytes=CHUNK) as store:
        store.put("a", torch.arange(100.0))
        store.put("b", -torch.arange(100.0))
        store.put("big", torch.arange(float(NUMEL)))
        yield store


def test_each_byte_is_read_once_and_written_once(store) -> None:
    pipeline = Pipeline(store, budget=3 * 2 * CHUNK)
    held: list[int] = []

    def work(job, tensors):
        held.append(pipeline.held)
        return _double(job, tensors)

    before = store.stats()
    pipeline.run(_jobs(), work)
    pipeline.drain()
    after = store.stats()
    state_bytes = (100 + 100 + 8192) * 4
    assert after["bytes_read"] - before["bytes_read"] == state_bytes
    assert after["bytes_written"] - before["bytes_written"] == state_bytes
    assert max(held) <= pipeline.budget
    assert max(held) > 2 * CHUNK  # it did read ahead
    assert pipeline.held == 0
    assert torch.equal(store.get("big")[:8192], 2 * torch.arange(8192.0))
    assert torch.equal(store.get("big")[8192:], torch.arange(8192.0, NUMEL))
    assert torch.equal(store.get("b"), -2 * torch.arange(100.0))


def test_resident_jobs_read_once_and_write_at_flush(store) -> None:
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    jobs = _jobs(resident=frozenset({0, 1}))
    pipeline.run(jobs, _double)
    pipeline.drain()
    reads_after_first = store.stats()["bytes_read"]
    pipeline.run(jobs, _double)
    pipeline.drain()
    assert pipeline.stats().host.hits == 2
    # the second pass read only the three streamed jobs
    assert store.stats()["bytes_read"] - reads_after_first == 3 * 2048 * 4
    assert torch.equal(store.get("a"), torch.arange(100.0))  # not yet written back
    pipeline.flush()
    assert torch.equal(store.get("a"), 4 * torch.arange(100.0))
    assert torch.equal(store.get("big")[:2048], 4 * torch.arange(2048.0))
    assert pipeline.held == 2 * 2 * CHUNK  # the resident jobs stay in memory


def test_resident_jobs_changed_since_a_flush_are_named_and_reload_from_the_store(store) -> None:
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    jobs = _jobs(resident=frozenset({0, 1}))
    pipeline.run(jobs, _double)
    assert [pipeline.unflushed(job.name) for job in jobs] == [True, True, False, False, False]
    pipeline.flush()
    assert not any(pipeline.unflushed(job.name) for job in jobs)
    pipeline.resident("small")[Region("a", 0, 100)].fill_(7.0)  # an edit the caller names
    pipeline.touch("small")
    pipeline.touch(2)  # not resident: nothing to name
    assert pipeline.unflushed("small")
    assert not pipeline.unflushed(2)
    pipeline.run(jobs[1:2], _double)
    # the stored copy of "a" and of job 1 (2x since the flush), back into their tensors
    pipeline.reload("small", [Region("a", 0, 100)])
    pipeline.reload(1, jobs[1].reads)
    pipeline.reload(3, jobs[3].reads)  # not resident: a no-op
    assert not pipeline.unflushed("small")
    assert not pipeline.unflushed(1)
    assert torch.equal(pipeline.resident("small")[Region("a", 0, 100)], 2 * torch.arange(100.0))
    assert torch.equal(pipeline.resident(1)[jobs[1].reads[0]], 2 * torch.arange(2048.0))
    pipeline.run(jobs, _double)
    pipeline.flush()
    assert torch.equal(store.get("a"), 4 * torch.arange(100.0))
    assert torch.equal(store.get("big")[:2048], 4 * torch.arange(2048.0))


def test_a_flush_leaves_out_transient_regions_and_an_evict_writes_them(store) -> None:
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    a, b = Region("a", 0, 100), Region("b", 0, 100)
    job = Job("small", (a, b), 2 * CHUNK, tier="host", transient=(b,))
    pipeline.run([job], _double)
    before = store.stats()["bytes_written"]
    pipeline.flush()
    assert store.stats()["bytes_written"] - before == 100 * 4  # "a" alone
    assert torch.equal(store.get("a"), 2 * torch.arange(100.0))
    assert torch.equal(store.get("b"), -torch.arange(100.0))  # as read
    assert pipeline.stats().host.bytes_out == 100 * 4
    pipeline.evict()  # its tensors go: all of them are written
    assert torch.equal(store.get("b"), -2 * torch.arange(100.0))


def test_a_flush_behind_ends_before_the_next_call_and_then_runs_after_its_writes(store) -> None:
    """flush_behind returns while its writes and ``then`` go on; ``then`` sees the writes
    landed; the next call that is not a query waits for it, and the resident jobs then count
    as flushed."""
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    jobs = _jobs(resident=frozenset({0, 1}))
    pipeline.run(jobs, _double)
    release, seen, ends = threading.Event(), [], []

    def then() -> str:
        seen.append(store.get("a").clone())  # the flush's write has landed
        release.wait(timeout=30)
        return "committed"

    future = pipeline.flush_behind(then, lambda error, at: ends.append((error, at)))
    assert pipeline.resident_tier("small") == "host"  # queries do not wait
    assert not pipeline.landed(2)
    assert not future.done()
    assert ends == []
    waited = threading.Thread(target=lambda: pipeline.unflushed("small"))
    waited.start()
    waited.join(timeout=0.2)
    assert waited.is_alive()  # the next call waits for ``then``
    release.set()
    waited.join(timeout=30)
    assert future.result() == "committed"
    assert torch.equal(seen[0], 2 * torch.arange(100.0))
    assert ends[0][0] is None
    assert ends[0][1] <= time.monotonic()
    assert not any(pipeline.unflushed(job.name) for job in jobs)
    assert pipeline.stats().host.bytes_out >= 2 * 2 * CHUNK


def test_a_failed_flush_behind_is_raised_once_and_leaves_the_jobs_unflushed(store) -> None:
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    jobs = _jobs(resident=frozenset({0}))
    pipeline.run(jobs, _double)
    ends: list[tuple[BaseException | None, float]] = []

    def then() -> None:
        raise OutOfSpaceError("no room for the commit")

    pipeline.flush_behind(then, lambda error, at: ends.append((error, at)))
    with pytest.raises(OutOfSpaceError, match="no room for the commit"):
        pipeline.release()  # the next call raises it, after ``ended``
    assert isinstance(ends[0][0], OutOfSpaceError)
    assert pipeline.unflushed("small")  # the store may lack its tensors
    pipeline.settle()  # raised once
    pipeline.flush()  # and a flush goes on as before
    assert not pipeline.unflushed("small")
    assert torch.equal(store.get("a"), 2 * torch.arange(100.0))
    writes_fail = Pipeline(FullDisk(store), budget=4 * 2 * CHUNK)
    writes_fail.run(jobs[:1], _double)
    called: list[str] = []
    writes_fail.flush_behind(lambda: called.append("then"), lambda error, at: None)
    with pytest.raises(OutOfSpaceError, match="disk full"):
        writes_fail.settle()
    assert called == []  # a failed write: no ``then``


def test_held_jobs_are_read_once_updated_in_place_and_written_at_flush(store) -> None:
    """hold() reads a job once (from a prefetch when one started it), keeps its bytes in the
    host budget while jobs stream beside it, and leaves writing to flush; other regions under
    the same name write the old ones back first; evict lets it go."""
    pipeline = Pipeline(store, budget=3 * 2 * CHUNK)
    scales = Job("scales", (Region("a", 0, 100),), CHUNK, tier="host")
    pipeline.prefetch([scales])
    held = pipeline.hold(scales)
    assert store.stats()["reads"] == 1
    assert pipeline.stats().host.misses == 1

    def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
        held[Region("a", 0, 100)].add_(1)  # the jobs' work updates the held tensors
        assert pipeline.held <= pipeline.budget
        return _double(job, tensors)

    for _ in range(2):
        assert pipeline.hold(scales) is held
        pipeline.run(_jobs()[1:], work)
        pipeline.drain()
    assert pipeline.stats().host.hits == 2
    assert pipeline.stats().host.misses == 1 + 8
    assert torch.equal(store.get("a"), torch.arange(100.0))  # not written by the passes
    pipeline.flush()
    assert torch.equal(store.get("a"), torch.arange(100.0) + 8)
    assert pipeline.held == CHUNK
    held[Region("a", 0, 100)].add_(1)
    other = Job("scales", (Region("b", 0, 100),), CHUNK, tier="host")
    assert torch.equal(pipeline.hold(other)[Region("b", 0, 100)], -torch.arange(100.0))
    assert torch.equal(store.get("a"), torch.arange(100.0) + 9)  # written back on the way out
    assert pipeline.held == CHUNK
    pipeline.evict()
    assert pipeline.held == 0


def test_prefetch_starts_reads_without_blocking(store) -> None:
    pipeline = Pipeline(store, budget=2 * 2 * CHUNK)
    jobs = _jobs()
    pipeline.prefetch(jobs)  # room for two: the rest is not started
    assert pipeline.held == 2 * 2 * CHUNK
    pipeline.run(jobs, _double)
    pipeline.drain()
    assert store.stats()["reads"] == 2 + 8  # every chunk once: the prefetched reads were used
    pipeline.prefetch(jobs[:1])
    pipeline.release()  # prefetched, never consumed
    assert pipeline.held == 0


def test_reads_ahead_leave_the_write_room_free_and_are_never_dropped_for_a_write(store) -> None:
    """With ``write_room`` set, reads started ahead stop short of it: a write-behind made
    meanwhile finds its room free, so no read ahead is dropped and read twice (without it,
    the write drops the latest one)."""
    for room, reads_ahead, dropped in ((0, 2, 1), (CHUNK, 1, 0)):
        before = store.stats()["reads"]
        pipeline = Pipeline(store, budget=2 * 2 * CHUNK)
        pipeline.write_room = room
        jobs = _jobs()[1:]
        pipeline.prefetch(jobs)
        assert pipeline.held == reads_ahead * 2 * CHUNK
        pipeline.write_behind({Region("a", 0, 100): torch.zeros(100)})  # one page
        pipeline.run(jobs, _double)
        pipeline.drain()
        assert store.stats()["reads"] - before == 8 + 2 * dropped  # a dropped job's twice
        assert pipeline.held == 0


def test_release_drops_only_the_named_reads(store) -> None:
    pipeline = Pipeline(store, budget=3 * 2 * CHUNK)
    jobs = _jobs()
    pipeline.prefetch(jobs[1:3])
    pipeline.release([jobs[1].name, "never started"])
    assert pipeline.held == 2 * CHUNK  # the other read goes on
    pipeline.run(jobs[1:3], _double)
    pipeline.drain()
    assert store.stats()["reads"] == 2 + 2 + 2  # the dropped job's chunks read again


def test_a_lent_job_holds_its_room_until_given_back_from_another_thread(store) -> None:
    """``lend``: a job read ahead (``landed`` once its reads are in) is lent without waiting;
    its bytes stay held until the function it returns gives them back, from any thread. A run
    that needs the room meanwhile waits for it (the copy reading the lent buffers will end)
    instead of refusing the job, and nothing is read twice."""
    pipeline = Pipeline(store, budget=2 * CHUNK)  # one job
    jobs = _jobs()[1:]
    pipeline.prefetch(jobs[:1])
    while not pipeline.landed(jobs[0].name):
        time.sleep(0.001)
    tensors, give_back = pipeline.lend(jobs[0])
    assert torch.equal(tensors[jobs[0].reads[0]], torch.arange(0.0, 2048.0))
    assert pipeline.held == 2 * CHUNK
    timer = threading.Timer(0.05, give_back)  # as a copy's completion would, later
    timer.start()
    pipeline.run(jobs[1:], _double)  # the lent job holds all the room: waits for it
    timer.join()
    pipeline.drain()
    assert pipeline.held == 0
    assert store.stats()["reads"] == 2 * 4  # every chunk of the four jobs once


def test_write_behind_copies_within_the_budget_and_orders_later_reads(store) -> None:
    pipeline = Pipeline(store, budget=2 * CHUNK)
    values = torch.full((2048,), 7.0)
    pipeline.write_behind({Region("big", 0, 2048): values})
    values.zero_()  # the caller's tensor is free again: a copy is written
    seen: list[torch.Tensor] = []
    pipeline.run([Job("read", (Region("big", 0, 2048),), 2 * CHUNK)], lambda job, t: (
        seen.append(t[Region("big", 0, 2048)].clone()) or {}
    ))  # fmt: skip
    pipeline.drain()
    assert torch.equal(seen[0], torch.full((2048,), 7.0))
    assert pipeline.held == 0
    with pytest.raises(BudgetError):  # larger than the budget
        pipeline.write_behind({Region("big", 0, 4096): torch.zeros(4096)})
    assert pipeline.held == 0


@pytest.mark.parametrize("how", ["write_behind", "write", "job"])
def test_a_write_drops_the_reads_started_ahead_that_it_overlaps(store, how: str) -> None:
    """A read started ahead of a write to its region has the bytes the write replaces: the
    write drops it, and the job that consumes it reads the new bytes (the others stay)."""
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    stale, other = _jobs()[1:3]
    pipeline.prefetch([stale, other])
    pipeline.run([other], lambda job, t: {})  # the other read was consumed: no drop needed
    pipeline.prefetch([other])
    new = torch.full((2048,), 5.0)
    target = Region("big", 0, 2048)
    if how == "write_behind":
        pipeline.write_behind({target: new})
    elif how == "write":
        pipeline.write({target: new}).result()
    else:  # a job that writes the region it did not read
        writer = Job("writer", (Region("a", 0, 100),), 2 * CHUNK)
        pipeline.run([writer], lambda job, t: {target: new.clone()})
    seen: dict[object, torch.Tensor] = {}
    pipeline.run(
        [stale, other], lambda job, t: seen.update({job.name: next(iter(t.values()))}) or {}
    )
    pipeline.drain()
    assert torch.equal(seen[stale.name], new)
    assert torch.equal(seen[other.name], torch.arange(2048.0, 4096.0))
    # two reads ahead, the other's again, the stale one's again (and the writer's): the stale
    # one's from the store, or copied from the write while it is in flight
    forwarded = pipeline.stats().nvme_bytes_forwarded // CHUNK
    assert store.stats()["reads"] + forwarded == 2 + 2 + 2 + 2 + (how == "job")


def test_an_unread_region_gets_a_buffer_that_the_work_fills(store) -> None:
    """``Job.unread``: a buffer like a read's, counted in the budget, not read from the
    store; the work fills it, and what it returns for it is written."""
    pipeline = Pipeline(store, budget=2 * 2 * CHUNK)
    filled = Region("big", 2048, 4096)
    job = Job("fill", (Region("big", 0, 2048),), 2 * 2 * CHUNK, unread=(filled,))
    assert job.buffers == (Region("big", 0, 2048), filled)

    def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
        assert set(tensors) == set(job.buffers)
        assert pipeline.held == 2 * 2 * CHUNK
        tensors[filled].fill_(9.0)
        return {filled: tensors[filled]}

    pipeline.run([job], work)
    pipeline.drain()
    assert store.stats()["reads"] == 2  # the read region's two chunks alone
    assert torch.equal(store.get("big")[2048:4096], torch.full((2048,), 9.0))
    assert pipeline.held == 0


def test_a_direct_write_orders_later_reads_and_reports_its_failure_to_its_caller(store) -> None:
    pipeline = Pipeline(store, budget=2 * CHUNK)
    values = torch.full((2048,), 3.0)
    written = pipeline.write({Region("big", 2048, 4096): values})  # no copy, no budget taken
    assert pipeline.held == 0
    seen: list[torch.Tensor] = []
    pipeline.run([Job("read", (Region("big", 2048, 4096),), 2 * CHUNK)], lambda job, t: (
        seen.append(t[Region("big", 2048, 4096)].clone()) or {}
    ))  # fmt: skip
    assert written.exception() is None
    assert torch.equal(seen[0], values)

    failing = Pipeline(FullDisk(store), budget=2 * CHUNK)
    with pytest.raises(OutOfSpaceError):
        failing.write({Region("big", 0, 2048): values}).result()
    failing.drain()  # the caller had it: not raised again
    assert torch.equal(store.get("big")[:2048], torch.arange(2048.0))


def test_a_job_larger_than_the_budget_is_refused(store) -> None:
    pipeline = Pipeline(store, budget=CHUNK)
    with pytest.raises(BudgetError, match="does not fit"):
        pipeline.run(_jobs()[1:2], _double)
    assert pipeline.held == 0


def test_failing_work_and_writes_release_everything(store) -> None:
    pipeline = Pipeline(store, budget=3 * 2 * CHUNK)

    def broken(job, tensors):
        raise RuntimeError("work failed")

    with pytest.raises(RuntimeError, match="work failed"):
        pipeline.run(_jobs(), broken)
    pipeline.release()
    assert pipeline.held == 0

    failing = Pipeline(FullDisk(store), budget=3 * 2 * CHUNK)
    with pytest.raises(OutOfSpaceError):  # raised by run() once a write-behind has failed
        failing.run(_jobs(), _double)
    failing.release()
    failing.drain()  # the failure was reported once
    assert failing.held == 0
    assert torch.equal(store.get("a"), torch.arange(100.0))


def test_a_write_that_cannot_start_fails_as_a_write_behind_and_releases_the_job(store) -> None:
    pipeline = Pipeline(store, budget=3 * 2 * CHUNK)

    def to_a_missing_key(job, tensors):
        return {Region("missing", 0, 1): torch.zeros(1)}

    pipeline.run(_jobs()[:1], to_a_missing_key)  # the write is behind the work
    with pytest.raises(KeyError):
        pipeline.drain()
    pipeline.drain()  # raised once
    pipeline.release()
    assert pipeline.held == 0
    with pytest.raises(KeyError):  # the next job's turn raises a failure not raised yet
        pipeline.run(_jobs()[:2], to_a_missing_key)
    pipeline.drain()
    pipeline.release()
    assert pipeline.held == 0


def test_failing_work_on_a_resident_job_keeps_it_resident(store) -> None:
    pipeline = Pipeline(store, budget=4 * 2 * CHUNK)
    jobs = _jobs(resident=frozenset({0}))
    pipeline.run(jobs[:1], _double)
    held = pipeline.held
    pipeline.flush()

    def broken(job, tensors):
        raise RuntimeError("work failed")

    with pytest.raises(RuntimeError):
        pipeline.run(jobs[:1], broken)
    assert pipeline.held == held
    assert pipeline.resident("small") is not None
    assert pipeline.unflushed("small")  # the work may have changed its tensors
    pipeline.flush()
    assert torch.equal(store.get("a"), 2 * torch.arange(100.0))


def _scratch_jobs() -> list[Job]:
    """Four jobs of one chunk of ``big`` each, asking for work buffers of one or two chunks."""
    reads = [(Region("big", 1024 * i, 1024 * (i + 1)),) for i in range(4)]
    return [Job(i, r, CHUNK, scratch=CHUNK * (1 + i % 2)) for i, r in enumerate(reads)]


def test_one_work_buffer_serves_every_job_and_is_reused(store, monkeypatch) -> None:
    import tierswap.engine._pool as pool_module

    allocated: list[int] = []
    allocate = pool_module.allocate

    def counting(shape, dtype, device=None, **kw):
        allocated.append(int(shape[0]))
        return allocate(shape, dtype, device, **kw)

    monkeypatch.setattr(pool_module, "allocate", counting)
    # two jobs in flight beside the work buffer of the largest request: a tight budget
    pipeline = Pipeline(store, budget=2 * CHUNK + 2 * CHUNK)
    seen: list[int] = []

    def work(job, tensors):
        buf = pipeline.scratch(job)
        assert buf is not None
        assert buf.numel() >= job.scratch
        assert buf.dtype == torch.uint8
        assert pipeline.held <= pipeline.budget
        seen.append(buf.data_ptr())
        buf.fill_(7)  # its contents are the work's own
        return _double(job, tensors)

    for _ in range(3):
        pipeline.run(_scratch_jobs(), work)
        pipeline.drain()
    first_pass = len(allocated)
    pipeline.run(_scratch_jobs(), work)
    pipeline.drain()
    assert len(allocated) == first_pass, "a later pass faulted in new buffers"
    assert len(set(seen)) == 1  # one work buffer, of the largest request, for every job
    assert pipeline.held == 2 * CHUNK  # the work buffer stays reserved between passes
    assert torch.equal(store.get("big")[:4096], 16 * torch.arange(4096.0))
    pipeline.evict()  # until the layout changes
    assert pipeline.held == 0


def test_a_work_buffer_that_does_not_fit_beside_the_resident_jobs_is_refused(store) -> None:
    pipeline = Pipeline(store, budget=4 * CHUNK)
    resident = Job("a", (Region("a", 0, 100),), 3 * CHUNK, tier="host")
    pipeline.run([resident], _double)
    pipeline.drain()
    with pytest.raises(BudgetError, match="work buffer"):
        pipeline.run([Job("b", (Region("b", 0, 100),), CHUNK, scratch=2 * CHUNK)], _double)
    assert pipeline.held == 3 * CHUNK  # the resident job, nothing else


def test_a_work_buffer_held_for_earlier_jobs_gives_way_to_jobs_that_need_none(store) -> None:
    """A run whose jobs need no work buffer may take the room of the one held since an
    earlier run's (kept between runs, so that it costs no page faults)."""
    pipeline = Pipeline(store, budget=4 * CHUNK)
    pipeline.run(_scratch_jobs()[:1], _double)
    pipeline.drain()
    assert pipeline.held == CHUNK  # the work buffer stays
    whole = Job("whole", (Region("big", 0, 4096),), 4 * CHUNK)
    pipeline.run([whole], _double)  # the whole budget: the work buffer goes
    pipeline.drain()
    assert pipeline.held == 0
    assert torch.equal(store.get("big")[:1024], 4 * torch.arange(1024.0))


def test_a_job_without_scratch_gets_none(store) -> None:
    pipeline = Pipeline(store, budget=4 * CHUNK)
    job = Job("a", (Region("a", 0, 100),), CHUNK)
    pipeline.run([job], lambda j, t: (pipeline.scratch(j), {})[1])
    assert pipeline.scratch(job) is None
    assert pipeline.held == 0
    with pytest.raises(ts.errors.ConfigError, match="scratch"):
        Job("b", (), CHUNK, scratch=-1)
