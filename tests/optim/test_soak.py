"""Long runs: a SwapOptimizer committing every step through thousands of steps, rotating
snapshots and close/resume cycles stays bitwise equal to torch's AdamW in memory, and its file
descriptors, threads and memory stay flat.

Usage is measured at two points of the run (after ``first`` steps and at the end), each time
with the optimizer live and again closed (a close and a resume in the same folder). The rule:

- file descriptors: equal, live and closed (+0: a leak of one per resume or snapshot shows);
- threads, closed: Python's equal (+0); the kernel's no more (torch's and pytest's native
  threads may end: pytest's faulthandler watchdog ends when it fires, at 240 s);
- threads, live: equal apart from the I/O pool's workers, which the pool starts lazily as I/O
  overlaps (their number at a point depends on timing, not on age), so they are only held to
  the pool's size;
- RSS, closed, after ``gc.collect()``: at most 5% above the first point, which comes after a
  warm-up of 2 resumes (one of each kind) and a few snapshots.

Run ``pytest tests/optim/test_soak.py -s`` to see the summary line.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batch_for_step,
    make_models,
    train_step,
)
from tierswap.config import IOConfig
from tierswap.optim import SwapOptimizer

KW = {"host_budget": 8192, "commit_every": 1, "lr": 1e-2, "weight_decay": 0.05}
KEEP_SNAPSHOTS = 3
RSS_SLACK = 1.05
IO_WORKER = "tierswap-io"  # the thread name prefix of the I/O pool (tierswap.io)
SPARES = "tierswap-spares"  # the spare pool's deleting thread (one per store folder)

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")


@dataclass(frozen=True)
class Usage:
    fds: int
    threads: int  # threading.active_count()
    kernel_threads: int  # /proc/self/status Threads: torch's native threads as well
    io_workers: int  # threads that start when first needed: the I/O pool, the spare pool
    rss_kib: int


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def usage() -> Usage:
    gc.collect()
    names = [t.name for t in threading.enumerate()]
    return Usage(
        fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(),
        kernel_threads=_status("Threads"),
        io_workers=sum(name.startswith((IO_WORKER, SPARES)) for name in names),
        rss_kib=_status("VmRSS"),
    )


@dataclass(frozen=True)
class Plan:
    steps: int
    first: int  # the step of the first measurement
    snapshot_every: int
    resume_every: int

    def resumes_at(self, step: int) -> bool:
        warm_up = (self.first // 3, 2 * self.first // 3)  # both kinds before the first point
        return step % self.resume_every == 0 or step in warm_up


class Soak:
    """The swap run beside its AdamW reference, with rotating snapshots and resumes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ref_model, self.model = make_models(seed=7)
        self.ref = torch.optim.AdamW(
            self.ref_model.named_parameters(), lr=KW["lr"], weight_decay=KW["weight_decay"]
        )
        self.swap_dir = root / "swap-0"
        self.opt = self._open(swap_dir=self.swap_dir)
        self.steps = 0
        self.resumes = 0
        self.snapshots: list[tuple[Path, int, list[torch.Tensor]]] = []  # path, step, params

    def _open(self, **where: object) -> SwapOptimizer:
        return SwapOptimizer(self.model.named_parameters(), torch.optim.AdamW, **where, **KW)

    def step(self) -> None:
        x = batch_for_step(self.steps)
        train_step(self.model, self.opt, x)
        train_step(self.ref_model, self.ref, x)
        self.steps += 1

    def snapshot(self) -> None:
        dest = self.root / f"snap-{self.steps}"
        self.opt.snapshot(dest)
        params = [p.detach().clone() for p in self.ref_model.parameters()]
        self.snapshots.append((dest, self.steps, params))
        if len(self.snapshots) > KEEP_SNAPSHOTS:
            shutil.rmtree(self.snapshots.pop(0)[0])

    def resume(self) -> None:
        """Close and resume: in turn from the folder itself, or from a snapshot taken now into
        a new folder (the old folder and the snapshot removed)."""
        self.resumes += 1
        if self.resumes % 2:
            self.reopen()
            return
        handover = self.root / f"handover-{self.steps}"
        self.opt.snapshot(handover)
        self.opt.close()
        shutil.rmtree(self.swap_dir)
        self.swap_dir = self.root / f"swap-{self.resumes}"
        self._scramble()
        self.opt = self._open(swap_dir=self.swap_dir, resume_from=handover)
        shutil.rmtree(handover)  # the new folder holds its own links to the files
        self._check_resumed()

    def reopen(self, between: list[Usage] | None = None) -> None:
        """Close, measure into ``between`` (when given), resume from the same folder."""
        self.opt.close()
        if between is not None:
            between.append(usage())
        self._scramble()
        self.opt = self._open(swap_dir=self.swap_dir, resume=True)
        self._check_resumed()

    def _scramble(self) -> None:
        """NaN weights: only the resume's restore can make them equal to the reference."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))

    def _check_resumed(self) -> None:
        assert self.opt.steps == self.steps
        assert_same_params(self.ref_model, self.model)

    def check_end(self) -> None:
        assert_same_params(self.ref_model, self.model)
        assert_same_state(self.ref.state_dict(), self.opt.state_dict())
        self.opt.close()
        for path, step, params in self.snapshots:  # each kept snapshot is still its step
            _, fresh = make_models(seed=11)
            with SwapOptimizer(
                fresh.named_parameters(), torch.optim.AdamW,
                swap_dir=self.root / f"check-{step}", resume_from=path, **KW,
            ) as opt:  # fmt: skip
                assert opt.steps == step
                for got, want in zip(fresh.parameters(), params, strict=True):
                    assert torch.equal(got, want), path


def run_soak(tmp_path: Path, plan: Plan) -> None:
    soak = Soak(tmp_path)
    live: list[Usage] = []
    closed: list[Usage] = []
    start = time.perf_counter()
    while soak.steps < plan.steps:
        soak.step()
        if soak.steps % plan.snapshot_every == 0:
            soak.snapshot()
        if soak.steps in (plan.first, plan.steps):
            live.append(usage())
            soak.reopen(between=closed)
        elif plan.resumes_at(soak.steps):
            soak.resume()
    soak.check_end()
    seconds = time.perf_counter() - start
    print(
        f"\nsoak: {plan.steps} steps, {soak.resumes} resumes, {plan.steps // plan.snapshot_every}"
        f" snapshots, {seconds:.0f} s; at step {plan.first} -> {plan.steps}: "
        f"fds {closed[0].fds} -> {closed[1].fds} (live {live[0].fds} -> {live[1].fds}), "
        f"threads {closed[0].threads} -> {closed[1].threads} "
        f"(kernel {closed[0].kernel_threads} -> {closed[1].kernel_threads}; live "
        f"{live[0].threads} -> {live[1].threads}, of which I/O workers {live[0].io_workers} -> "
        f"{live[1].io_workers}), RSS {closed[0].rss_kib / 1024:.1f} -> "
        f"{closed[1].rss_kib / 1024:.1f} MiB ({closed[1].rss_kib / closed[0].rss_kib - 1:+.2%})"
    )
    check_usage(live, closed)


def check_usage(live: list[Usage], closed: list[Usage]) -> None:
    before, after = closed
    assert after.fds == before.fds, closed
    assert after.threads == before.threads, closed
    assert after.kernel_threads <= before.kernel_threads, closed
    assert after.rss_kib <= RSS_SLACK * before.rss_kib, closed
    before, after = live
    assert after.fds == before.fds, live
    assert after.threads - after.io_workers == before.threads - before.io_workers, live
    # A Python thread's first parallel torch op gives it an OpenMP team of native threads: the
    # step worker's may first appear after step 30 (when speculation first ran a large op on
    # it), once; a leak would grow by that at every resume.
    team = torch.get_num_threads() - 1
    native = after.kernel_threads - after.threads
    assert native <= before.kernel_threads - before.threads + team, live
    assert after.io_workers <= IOConfig().threads + 1, live  # (+ the spares' thread)


def test_soak_short(tmp_path: Path) -> None:
    """300 steps, measured at 30 and 300 (about 15 s on 2 cores)."""
    run_soak(tmp_path, Plan(steps=300, first=30, snapshot_every=10, resume_every=100))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_10000_steps(tmp_path: Path) -> None:
    """10,000 steps, measured at 100 and 10,000 (7-13 min on 2 cores, by load)."""
    run_soak(tmp_path, Plan(steps=10_000, first=100, snapshot_every=50, resume_every=250))
