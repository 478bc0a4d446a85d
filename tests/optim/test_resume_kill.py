"""A training process SIGKILLed mid-run resumes bit-exact from its last commit; so does one
folder through many kills at random moments (``run_kill_trials``)."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.optim.compact_reference import CompactReference
from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batch_for_step,
    make_models,
    train_step,
)
from tests.optim.train_child import (
    AUTO_KWARGS,
    CHILD_KWARGS,
    CHILD_LR_DECAY,
    COMPACT_KWARGS,
    MUON_KWARGS,
    MUON_LR,
    STREAM_KWARGS,
    compact_net,
    muon_groups,
)
from tierswap.optim import SwapOptimizer

ROOT = Path(__file__).resolve().parents[2]


def _run_until_killed(swap_dir: Path, min_steps: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.optim.train_child", str(swap_dir), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in child.stdout:
            if int(line.split()[1]) >= min_steps:
                break
        else:
            raise AssertionError(f"child stopped early: {child.stderr.read()}")
    finally:
        child.send_signal(signal.SIGKILL)  # no clean-up, mid-step or mid-commit
        child.wait(timeout=60)
        child.stdout.close()
        child.stderr.close()


def _child_reference(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, float]:
    """The child's AdamW run in memory through ``steps`` steps: model, optimizer, scheduler,
    and the lr of the last step."""
    ref_model, _ = make_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05)
    ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=CHILD_LR_DECAY)
    last_lr = ref.param_groups[0]["lr"]
    for step in range(steps):
        train_step(ref_model, ref, batch_for_step(step))
        last_lr = ref.param_groups[0]["lr"]
        ref_sched.step()
    return ref_model, ref, ref_sched, last_lr


@pytest.mark.parametrize(
    ("recipe", "kwargs", "least"),
    [("adamw", CHILD_KWARGS, 5), ("auto", AUTO_KWARGS, 1)],
    ids=["commit-every-step", "commits-behind"],
)
def test_sigkilled_run_resumes_bit_exact(tmp_path, recipe, kwargs, least) -> None:
    """Killed after its eighth step (or fifth, committing every step), the folder holds a
    commit whole, and the resumed run goes on as torch's AdamW. ``commits-behind``:
    ``commit_every="auto"``, whose commits write the state resident in RAM on a thread while
    the next step goes on, so that a kill may come in the middle of one; the first step
    commits."""
    swap_dir = tmp_path / "run"
    _run_until_killed(swap_dir, 8 if recipe == "auto" else 5, recipe)
    _, model = make_models(seed=11)  # the resume overwrites these weights
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **kwargs
    )
    with opt:
        done = opt.steps
        assert done >= least
        ref_model, ref, ref_sched, last_lr = _child_reference(done)
        assert_same_params(ref_model, model)
        # the commit is made in step(), before the scheduler moved lr on: it holds the lr of
        # the last committed step (a resumed run restores its scheduler separately)
        assert opt.param_groups[0]["lr"] == last_lr
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
        assert_same_state(ref.state_dict(), opt.state_dict())
        for step in range(done, done + 2):
            train_step(ref_model, ref, batch_for_step(step))
            train_step(model, opt, batch_for_step(step))
            ref_sched.step()
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
        assert_same_params(ref_model, model)


def test_sigkilled_streaming_run_resumes_bit_exact(tmp_path) -> None:
    """Parameters and gradients in the swap folder too (offload_parameters): killed mid-run,
    the commit holds the parameters, and the resumed run goes on as torch's AdamW."""
    swap_dir = tmp_path / "run"
    _run_until_killed(swap_dir, 5, "stream")
    _, model = make_models(seed=11)  # the resume overwrites these weights
    opt = SwapOptimizer(model, torch.optim.AdamW, swap_dir=swap_dir, resume=True, **STREAM_KWARGS)
    with opt:
        done = opt.steps
        assert done >= 5
        ref_model, ref, ref_sched, _ = _child_reference(done)
        for name, value in model.state_dict().items():  # read from the commit
            assert torch.equal(value, ref_model.state_dict()[name]), name
        for step in range(done, done + 2):
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
            train_step(ref_model, ref, batch_for_step(step))
            train_step(model, opt, batch_for_step(step))
            ref_sched.step()
    assert_same_params(ref_model, model)  # close() gave the model its values


def test_sigkilled_8bit_run_resumes_bit_exact(tmp_path) -> None:
    """8-bit moments whose scales the layout holds in host memory: each commit writes them,
    so the resumed run equals a reference that rounds its moments as they are stored."""
    swap_dir = tmp_path / "run"
    _run_until_killed(swap_dir, 5, "8bit")
    model = compact_net()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the resume restores the parameters
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **COMPACT_KWARGS
    )
    with opt:
        assert opt._layout.held_scales > 0
        assert not opt.placement
        done = opt.steps
        assert done >= 5
        ref_model = compact_net()
        kwargs = {"lr": CHILD_KWARGS["lr"], "weight_decay": CHILD_KWARGS["weight_decay"]}
        ref = CompactReference(ref_model, torch.optim.AdamW, kwargs, "8bit")
        ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref.opt, gamma=CHILD_LR_DECAY)
        for step in range(done):
            ref.step(batch_for_step(step))
            ref_sched.step()
        assert_same_params(ref_model, model)
        for step in range(done, done + 2):
            opt.param_groups[0]["lr"] = ref.opt.param_groups[0]["lr"]
            ref.step(batch_for_step(step))
            train_step(model, opt, batch_for_step(step))
            ref_sched.step()
        assert_same_params(ref_model, model)


def test_sigkilled_muon_and_adamw_run_resumes_bit_exact(tmp_path) -> None:
    """Muon (whole matrices) beside AdamW in one optimizer: killed, resumed, bitwise."""
    swap_dir = tmp_path / "run"
    _run_until_killed(swap_dir, 4, "muon")
    _, model = make_models(seed=11)  # the resume overwrites these weights
    opt = SwapOptimizer(
        muon_groups(model), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **MUON_KWARGS
    )
    with opt:
        done = opt.steps
        assert done >= 4
        assert len(opt.slices) > 1
        ref_model, _ = make_models()
        groups = muon_groups(ref_model)
        muon = torch.optim.Muon(groups[0]["params"], lr=MUON_LR)
        adamw = torch.optim.AdamW(groups[1]["params"], lr=1e-2, weight_decay=0.05)
        scheds = [
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=CHILD_LR_DECAY) for o in (muon, adamw)
        ]
        for step in range(done + 2):
            if step >= done:  # the resumed run continues in lock-step
                for swap_group, ref in zip(opt.param_groups, (muon, adamw), strict=True):
                    swap_group["lr"] = ref.param_groups[0]["lr"]
                train_step(model, opt, batch_for_step(step))
            muon.zero_grad()
            train_step(ref_model, adamw, batch_for_step(step))  # zero_grad, backward, AdamW
            muon.step()
            for sched in scheds:
                sched.step()
            if step == done - 1:
                assert_same_params(ref_model, model)
        assert_same_params(ref_model, model)


class ForkServer:
    """``train_child --serve``: forks children that resume a folder and train until killed."""

    def __init__(self, stderr: Path) -> None:
        self._stderr_path = stderr
        self._stderr = stderr.open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.optim.train_child", "--serve"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        )  # fmt: skip
        self.pid = 0  # the child, until reaped
        self.lines: list[list[str]] = []  # the child's lines since the fork

    def _read(self) -> list[str]:
        words = self._proc.stdout.readline().split()
        if not words or words[0] == "failed":
            raise AssertionError(f"child or server failed: {self._stderr_path.read_text()}")
        return words

    def _send(self, line: str) -> None:
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def fork(self, swap_dir: Path) -> None:
        self._send(f"resume {swap_dir}")
        self.lines = []
        while (words := self._read())[0] != "forked":
            self.lines.append(words)  # the child wrote before the server
        self.pid = int(words[1])

    def wait_commits(self, n: int) -> None:
        """Until the child has committed ``n`` steps since its fork."""
        while sum(words[0] == "committed" for words in self.lines) < n:
            self.lines.append(self._read())

    def kill(self) -> None:
        """SIGKILL the child, then read all it wrote until the server reaped it."""
        os.kill(self.pid, signal.SIGKILL)  # still ours: a zombie until the server reaps it
        self._send("reap")
        while (words := self._read())[0] != "reaped":
            self.lines.append(words)
        assert words[1:] == [str(self.pid), str(-signal.SIGKILL)], words
        self.pid = 0

    def close(self) -> None:
        self._proc.stdin.close()  # the server kills a child still running, and exits
        try:
            self._proc.wait(timeout=60)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()
            self._stderr.close()


class Reference:
    """Plain AdamW in memory, moved on to the step a resumed folder holds."""

    def __init__(self) -> None:
        self.model, _ = make_models()
        kwargs = {k: CHILD_KWARGS[k] for k in ("lr", "weight_decay")}
        self.opt = torch.optim.AdamW(self.model.parameters(), **kwargs)
        self.steps = 0

    def advance_to(self, steps: int) -> None:
        assert steps >= self.steps, (steps, self.steps)
        for step in range(self.steps, steps):
            train_step(self.model, self.opt, batch_for_step(step))
        self.steps = steps


def _resume_and_check(swap_dir: Path, ref: Reference, reported: int, more: int) -> None:
    """Resume in this process: bitwise the reference at the folder's step; ``more`` steps on
    (committed, for the next child to resume)."""
    _, model = make_models(seed=11)  # the resume overwrites these weights
    with SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **CHILD_KWARGS
    ) as opt:
        # the child prints after each commit: a kill between the two loses one line
        assert opt.steps in (reported, reported + 1), (opt.steps, reported)
        ref.advance_to(opt.steps)
        assert_same_params(ref.model, model)
        assert_same_state(ref.opt.state_dict(), opt.state_dict())
        for _ in range(more):
            train_step(model, opt, batch_for_step(ref.steps))
            ref.advance_to(ref.steps + 1)
        assert_same_params(ref.model, model)


MAX_DELAY_S = 0.25  # a kill after a random delay: in the resume (~50 ms) or the first steps
STEP_S = 0.05  # about one step on 2 cores: the extra sleep after a number of commits


def _kill_at_random(server: ForkServer, rng: random.Random) -> str:
    """Kill the child at a random moment; returns where it was: resuming, or after n
    commits of its own."""
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0, MAX_DELAY_S))
    else:
        server.wait_commits(rng.randint(1, 3))
        time.sleep(rng.uniform(0, STEP_S))
    server.kill()
    if not any(words[0] == "resumed" for words in server.lines):
        return "resuming"
    commits = sum(words[0] == "committed" for words in server.lines)
    return f"{min(commits, 3)}{'+' if commits >= 3 else ''} commits"


def run_kill_trials(tmp_path: Path, trials: int, seed: int) -> None:
    """One folder lives through ``trials`` crashes: a child resumes it and trains until killed
    at a random moment; this process resumes it, checks it bitwise against the reference and
    commits 1-2 steps more."""
    rng = random.Random(seed)
    swap_dir = tmp_path / "run"
    ref = Reference()
    _, model = make_models()
    with SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **CHILD_KWARGS
    ) as opt:
        train_step(model, opt, batch_for_step(0))
    ref.advance_to(1)
    where: collections.Counter[str] = collections.Counter()
    server = ForkServer(tmp_path / "server.err")
    start = time.perf_counter()
    try:
        for _ in range(trials):
            server.fork(swap_dir)
            where[_kill_at_random(server, rng)] += 1
            reported = max(
                [ref.steps] + [int(w[1]) for w in server.lines if w[0] in ("resumed", "committed")]
            )
            _resume_and_check(swap_dir, ref, reported, more=rng.randint(1, 2))
    finally:
        server.close()
    seconds = time.perf_counter() - start
    print(
        f"\nkill trials: {trials} (seed {seed}), all resumed bit-exact; {ref.steps} steps in the "
        f"folder; {seconds:.0f} s, {seconds / trials:.2f} s a trial; killed: "
        + ", ".join(f"{key} {where[key]}" for key in sorted(where))
    )


def test_random_kills_resume_bit_exact(tmp_path) -> None:
    """8 trials, about 5 s."""
    run_kill_trials(tmp_path, trials=8, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_1000_random_kills_resume_bit_exact(tmp_path) -> None:
    """1,000 trials, about 6 min on 2 cores (0.34 s a trial: a fork, not a new interpreter)."""
    run_kill_trials(tmp_path, trials=1000, seed=2)
