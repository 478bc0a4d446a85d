"""When commits happen: every N steps, or "auto" (a bounded share of the time)."""

from __future__ import annotations

import pytest
import torch

from tierswap.errors import ConfigError
from tierswap.optim import SwapOptimizer
from tierswap.optim.persist._commit_clock import AUTO_SHARE, BEHIND_BELOW, CommitClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train(
    clock: CommitClock, time: FakeTime, steps: int, step_s: float, commit_s: float,
    *, param_write_s: float = 0.0,
) -> list[int]:  # fmt: skip
    """Steps of ``step_s`` seconds; a due step also writes the params (``param_write_s``) and
    then commits (``commit_s``). Returns the steps that committed."""
    committed = []
    for step in range(1, steps + 1):
        due = clock.due(step)
        assert clock.due(step) is due  # asked again (hooks, then step()): the same answer
        time.now += step_s + (param_write_s if due else 0.0)
        clock.stepped()
        if due:
            time.now += commit_s
            clock.committed(commit_s)
            committed.append(step)
    return committed


def test_every_n_steps_and_never() -> None:
    time = FakeTime()
    assert _train(CommitClock(3, time), time, 10, 1.0, 5.0) == [3, 6, 9]
    assert _train(CommitClock(0, time), time, 10, 1.0, 5.0) == []


@pytest.mark.parametrize(("step_s", "commit_s"), [(1.0, 0.01), (1.0, 0.5), (0.2, 3.0)])
def test_auto_keeps_commits_to_their_share_of_the_time(step_s, commit_s) -> None:
    time = FakeTime()
    committed = _train(CommitClock("auto", time), time, 400, step_s, commit_s)
    assert committed[0] == 1  # nothing measured yet: the first step commits
    spent = len(committed) * commit_s
    assert spent <= AUTO_SHARE * time.now * 1.1  # never much more than the share
    # and not much less either: the commits are as frequent as the share allows
    interval = commit_s * (1 / AUTO_SHARE - 1)
    assert len(committed) >= 0.8 * time.now / (interval + step_s + commit_s)


def test_auto_counts_the_params_a_due_step_writes() -> None:
    """The step before a commit writes the parameters: that time is part of the commit's."""
    time = FakeTime()
    committed = _train(CommitClock("auto", time), time, 400, 1.0, 0.1, param_write_s=0.9)
    spent = len(committed) * (0.1 + 0.9)
    assert spent <= AUTO_SHARE * time.now * 1.1
    assert len(committed) > 10


def test_an_explicit_commit_restarts_the_interval() -> None:
    time = FakeTime()
    clock = CommitClock("auto", time)
    _train(clock, time, 2, 1.0, 1.0)  # step 1 commits (1 s); step 2 runs without, timed
    time.now += 7.0
    clock.committed(1.0)  # commit() by hand
    time.now += 7.0
    assert not clock.due(3)  # 7 s since that commit and a 1 s step: below 9 x 1 s
    time.now += 1.0
    clock.stepped()
    assert not clock.due(3)  # decided once per step
    assert clock.due(4)  # 8 s and a 1 s step


@pytest.mark.parametrize("every", [-1, 1.5, "sometimes", True])
def test_bad_commit_every_is_a_config_error(every, tmp_path) -> None:
    with pytest.raises(ConfigError, match="commit_every"):
        SwapOptimizer([torch.nn.Parameter(torch.zeros(4))], swap_dir=tmp_path, commit_every=every)


def test_auto_is_the_default_and_close_commits_what_is_left(tmp_path) -> None:
    model = torch.nn.Linear(8, 8)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", lr=0.1) as opt:
        assert opt._parts.commits.every == "auto"
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        expected = [p.detach().clone() for p in model.parameters()]
    again = torch.nn.Linear(8, 8)
    with SwapOptimizer(again.parameters(), swap_dir=tmp_path / "s", lr=0.1, resume=True) as opt:
        assert opt.steps == 3
        for a, b in zip(again.parameters(), expected, strict=True):
            assert torch.equal(a, b)


def test_auto_measures_a_step_without_a_commit_before_committing_again() -> None:
    """Were every step due, the params' writes would never be priced: a step whose commit
    costs little but whose params' writes cost a lot would commit every time."""
    time = FakeTime()
    clock = CommitClock("auto", time)
    committed = _train(clock, time, 50, 0.5, 0.001, param_write_s=0.5)
    assert committed[:2] != [1, 2]  # the second step runs without a commit, and is timed
    assert len(committed) * (0.001 + 0.5) <= AUTO_SHARE * time.now * 1.1


def test_auto_commits_every_step_under_torch_distributed(monkeypatch, tmp_path) -> None:
    """Each rank commits its own folder and a resume needs them all at one step: "auto",
    which times each rank's commits on its own, would let them drift apart."""
    from tierswap.optim import _assembly

    monkeypatch.setattr(_assembly, "world", lambda: (0, 2))
    model = torch.nn.Linear(4, 4)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", lr=0.1) as opt:
        assert opt._parts.commits.every == 1
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "t", commit_every=5) as opt:
        assert opt._parts.commits.every == 5


def _behind_decisions(every: int | str, busy: float, steps: int = 40) -> list[tuple[int, bool]]:
    """Steps of 1 s between which the process keeps ``busy`` of its 4 cores busy (the forward)
    and then computes 0.2 s on one core (the step); commits cost 0.5 s, on one core when they
    end within their step. Returns (step, behind) of the steps that committed."""
    time, cpu = FakeTime(), FakeTime()
    clock = CommitClock(every, time, cpu, cores=4)
    decided = []
    for step in range(1, steps + 1):
        time.now += 1.0
        cpu.now += 4 * busy
        if not clock.due(step):
            time.now += 0.2
            cpu.now += 0.2
            clock.stepped()
            continue
        time.now += 0.2
        cpu.now += 0.2
        clock.stepped()
        behind = clock.behind()
        decided.append((step, behind))
        if not behind:
            time.now += 0.5
            cpu.now += 0.5
            clock.committed(0.5)
        else:  # its end is seen in the next forward; what that forward costs is not measured
            clock.committed(0.5, behind=True)
    return decided


@pytest.mark.parametrize("busy", [0.05, BEHIND_BELOW - 0.1])
def test_auto_ends_commits_behind_forwards_that_leave_the_cpu_idle(busy) -> None:
    decided = _behind_decisions("auto", busy)
    assert decided[0] == (1, False)  # nothing measured yet: it ends within its step
    assert len(decided) > 3
    assert all(behind for _, behind in decided[1:])


@pytest.mark.parametrize("busy", [BEHIND_BELOW, 1.0])
def test_auto_ends_commits_within_steps_whose_forwards_keep_the_cpu_busy(busy) -> None:
    decided = _behind_decisions("auto", busy)
    assert len(decided) > 3
    assert not any(behind for _, behind in decided)


def test_commit_every_n_always_ends_within_its_step() -> None:
    """``commit_every=N`` promises a commit when step() returns (kill -9 resumes from it)."""
    decided = _behind_decisions(2, 0.0, steps=10)
    assert decided == [(step, False) for step in range(2, 11, 2)]


def test_a_forward_that_turns_busy_ends_the_commits_behind() -> None:
    """The CPU's share is measured again after every commit that ended within its step and
    every step without a commit, so a run whose forward turns busy stops committing behind."""
    time, cpu = FakeTime(), FakeTime()
    clock = CommitClock("auto", time, cpu, cores=2)
    for step, busy in [(1, 0.1), (2, 0.1)]:
        time.now += 1.0
        cpu.now += 2 * busy
        clock.due(step)
        clock.stepped()
        if step == 1:
            clock.committed(0.01)
    assert clock.busy == pytest.approx(0.1)
    time.now += 1.0
    cpu.now += 2 * 0.9  # busy from here on
    assert clock.due(3)
    clock.stepped()
    assert clock.busy == pytest.approx(0.9)
    assert not clock.behind()
