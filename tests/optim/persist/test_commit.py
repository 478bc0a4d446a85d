"""Commits at the end of a step: with ``commit_every="auto"`` and a forward that leaves the CPU
idle they end behind the caller, and the swap space's next use waits for them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tests.optim.models import assert_same_params, batches, make_models, train_step
from tierswap.errors import OutOfSpaceError
from tierswap.optim import SwapOptimizer
from tierswap.optim.persist import CommitClock

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


class StoreCommits:
    """Wraps ``SwapStore.commit`` of every store: a commit waits while :attr:`held` is set
    (until :attr:`go`), and :attr:`fail` of them raise, as on a full disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held = False
        self.go = threading.Event()
        self.waiting = threading.Event()
        self.fail = 0
        self.threads: list[str] = []
        commit = ts.SwapStore.commit

        def wrapped(store: ts.SwapStore, *args: object, **kwargs: object) -> int:
            self.threads.append(threading.current_thread().name)
            if self.held:
                self.waiting.set()
                assert self.go.wait(timeout=60), "the test never let the commit go"
            if self.fail:
                self.fail -= 1
                raise OutOfSpaceError("no room for the commit's index")
            return commit(store, *args, **kwargs)

        monkeypatch.setattr(ts.SwapStore, "commit", wrapped)


@pytest.fixture
def ends_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every due commit of ``"auto"`` ends behind its step, the first included, as when the
    forwards leave the CPU idle (the clock's measure of that: ``test_commit_clock``)."""
    monkeypatch.setattr(CommitClock, "behind", lambda clock: clock.every == "auto")


def _committed_steps(path: Path) -> int:
    with ts.SwapStore(path, mode="r") as reader:  # a reader: the optimizer holds the lock
        return int(reader.meta.get("tierswap.optim", {}).get("steps", 0))


@pytest.mark.parametrize("host_budget", ["64KiB", None], ids=["streamed", "resident"])
def test_a_commit_of_auto_ends_behind_the_next_forward(
    tmp_path, monkeypatch, ends_behind, host_budget
) -> None:
    """With ``commit_every="auto"`` step() returns while its commit is still to be recorded;
    the next forward runs beside it; the next use of the swap space waits for it; training
    stays bitwise, and ``synchronize()`` waits for the commit."""
    commits = StoreCommits(monkeypatch)
    model, ref = make_models()
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    swap_dir = tmp_path / "swap"
    opt = SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, swap_dir=swap_dir, host_budget=host_budget,
        **ADAMW,
    )  # fmt: skip
    xs = batches(4)
    commits.held = True
    train_step(model, opt, xs[0])  # returns: the first step commits (nothing measured yet)
    train_step(ref, plain, xs[0])
    assert commits.waiting.wait(timeout=60)
    assert commits.threads == ["tierswap-behind"]
    assert _committed_steps(swap_dir) == 0
    opt.zero_grad()
    loss = model(xs[1]).square().mean()  # the next forward does not wait for it
    commits.held = False
    commits.go.set()
    loss.backward()  # the slices it steps use the swap space after the commit
    opt.step()
    opt.synchronize()
    assert _committed_steps(swap_dir) >= 1
    for x in xs[1:]:
        train_step(ref, plain, x)
    for x in xs[2:]:
        train_step(model, opt, x)
    opt.close()
    assert_same_params(model, ref)
    assert _committed_steps(swap_dir) == 4


def test_a_commit_of_commit_every_n_ends_in_its_step(tmp_path, monkeypatch) -> None:
    commits = StoreCommits(monkeypatch)
    model, _ = make_models()
    swap_dir = tmp_path / "swap"
    with SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, swap_dir=swap_dir, commit_every=2, **ADAMW
    ) as opt:
        for step, x in enumerate(batches(4), start=1):
            train_step(model, opt, x)
            assert _committed_steps(swap_dir) == step // 2 * 2
    assert commits.threads == ["MainThread"] * 2


def test_a_failed_commit_behind_is_raised_by_the_next_use_and_a_later_commit_holds_all(
    tmp_path, monkeypatch, ends_behind
) -> None:
    """The failure is raised once, by the next use of the swap space; the folder keeps its
    last commit; training goes on, and a later commit holds everything (a resume continues
    bitwise)."""
    commits = StoreCommits(monkeypatch)
    model, ref = make_models()
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    swap_dir = tmp_path / "swap"
    kwargs = {"swap_dir": swap_dir, "host_budget": "64KiB", **ADAMW}
    opt = SwapOptimizer(model.named_parameters(), torch.optim.AdamW, **kwargs)
    xs = batches(5)
    commits.fail = 1
    train_step(model, opt, xs[0])
    train_step(ref, plain, xs[0])
    with pytest.raises(OutOfSpaceError, match="no room for the commit"):
        opt.synchronize()
    opt.synchronize()  # raised once
    assert _committed_steps(swap_dir) == 0
    for x in xs[1:4]:
        train_step(model, opt, x)
        train_step(ref, plain, x)
    opt.close()  # commits what the clock left
    assert _committed_steps(swap_dir) == 4
    resumed = SwapOptimizer(model.named_parameters(), torch.optim.AdamW, resume=True, **kwargs)
    assert resumed.steps == 4
    train_step(model, resumed, xs[4])
    train_step(ref, plain, xs[4])
    resumed.close()
    assert_same_params(model, ref)


@pytest.mark.parametrize("gpu_like", [True, False], ids=["forward-off-the-cpu", "forward-on-it"])
def test_auto_ends_commits_behind_a_forward_that_leaves_the_cpu_idle(
    tmp_path, monkeypatch, gpu_like
) -> None:
    """A forward that waits off the CPU (as on a GPU) lets the commits after the second step
    end behind; the first commits within its step (nothing measured yet). A forward that keeps
    the cores busy keeps every commit within its step (faked here: the clock's CPU time then
    runs with the wall clock on every core)."""
    commits = StoreCommits(monkeypatch)
    if not gpu_like:
        monkeypatch.setattr(time, "process_time", lambda: time.monotonic() * 64)
    model, ref = make_models()
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    opt = SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, swap_dir=tmp_path / "swap", **ADAMW
    )
    for x in batches(400):  # until the clock commits again (a slow disk's sync: later)
        time.sleep(0.03)  # the forward's time off the CPU
        train_step(model, opt, x)
        train_step(ref, plain, x)
        if len(commits.threads) >= 2:
            break
    opt.close()
    assert_same_params(model, ref)
    assert commits.threads[:2] == ["MainThread", "tierswap-behind" if gpu_like else "MainThread"]
