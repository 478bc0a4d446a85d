"""The optimizer examples run end to end (tiny sizes), so `make demo` cannot rot unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_demo_tiny_run_is_bit_identical_to_adamw(tmp_path) -> None:
    out = _run(
        "demo.py", "--swap-dir", str(tmp_path / "swap"), "--layers", "1", "--dim", "64",
        "--vocab", "512", "--seq", "16", "--steps", "2", "--host-budget", "256KiB",
    )  # fmt: skip
    assert "parameters bit-identical to in-memory AdamW: True" in out
    assert "nvme   read" in out


def test_plain_loop_runs_and_resumes(tmp_path) -> None:
    swap = str(tmp_path / "swap")
    first = _run("plain_loop.py", "--swap-dir", swap, "--steps", "2")
    assert "step    2" in first
    again = _run("plain_loop.py", "--swap-dir", swap, "--steps", "1", "--resume")
    assert "step    3" in again  # the step count continues from the commit


def test_muon_recipe_is_bit_identical_to_muon_and_adamw(tmp_path) -> None:
    out = _run("muon_recipe.py", "--swap-dir", str(tmp_path / "swap"), "--steps", "3")
    assert "parameters bit-identical to in-memory Muon + AdamW: True" in out
    assert "muon matrices: 4" in out
