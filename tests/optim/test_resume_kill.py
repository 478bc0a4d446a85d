"""A training process SIGKILLed mid-run resumes bit-exact from its last commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.optim.models import (
    assert_same_params,
    assert_same_state,
    batch_for_step,
    make_models,
    train_step,
)
from tests.optim.train_child import CHILD_KWARGS, CHILD_LR_DECAY, MUON_KWARGS, MUON_LR, muon_groups
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


def test_sigkilled_run_resumes_bit_exact(tmp_path) -> None:
    swap_dir = tmp_path / "run"
    _run_until_killed(swap_dir, min_steps=5)
    _, model = make_models(seed=11)  # the resume overwrites these weights
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **CHILD_KWARGS
    )
    with opt:
        done = opt.steps
        assert done >= 5
        ref_model, _ = make_models()
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05)
        ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=CHILD_LR_DECAY)
        for step in range(done):
            train_step(ref_model, ref, batch_for_step(step))
            last_lr = ref.param_groups[0]["lr"]
            ref_sched.step()
        assert_same_params(ref_model, model)
        # the commit happens inside step(), before the scheduler moved lr on: it holds the lr
        # of the last committed step (a resumed run restores its scheduler separately)
        assert opt.param_groups[0]["lr"] == last_lr
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
        assert_same_state(ref.state_dict(), opt.state_dict())
        for step in range(done, done + 2):
            train_step(ref_model, ref, batch_for_step(step))
            train_step(model, opt, batch_for_step(step))
            ref_sched.step()
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
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
