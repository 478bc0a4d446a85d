"""SIGKILL a writer at random instants; the reopened store must equal its last commit exactly."""

from __future__ import annotations

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

import tierswap as ts
from tests.store import crash_region_writer, crash_writer

ROOT = Path(__file__).parents[2]
#: Writers whose commits the tests kill: whole puts and deletes, and region writes (partial and
#: whole chunks, into recycled chunk files).
WRITERS = {"puts": crash_writer, "regions": crash_region_writer}


def _kill_at_random(writer: Any, path: Path, start: int, rng: random.Random) -> int:
    """Run the writer until it has committed past ``start``, kill it; return the last printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(writer.__file__), str(path), str(start)]
    last, target = start, start + rng.randint(1, 3)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stderr is not None
        while last < target:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"writer died early: {child.stderr.read()}")
            last = int(line)
        time.sleep(rng.uniform(0, 0.05))  # land anywhere inside the next commit cycle
        child.send_signal(signal.SIGKILL)
        child.wait()
        for line in child.stdout:  # commits printed between the sleep and the kill
            last = int(line)
    return last


def _check_reopened(writer: Any, path: Path, last_printed: int) -> int:
    with ts.SwapStore(path) as store:
        generation = store.generation
        # The kill may land after a commit point but before its number was printed.
        assert generation in (last_printed, last_printed + 1)
        assert store.meta == {"gen": generation}
        state = writer.expected(generation)
        assert store.keys() == sorted(state)
        for key, value in state.items():
            assert torch.equal(store.get(key), value), (generation, key)
        assert store.verify() == []
    return generation


def _run(path: Path, kills: int, seed: int, writer: Any = crash_writer) -> None:
    rng = random.Random(seed)
    generation = 0
    for _ in range(kills):
        printed = _kill_at_random(writer, path, generation, rng)
        generation = _check_reopened(writer, path, printed)
        staging = path / ".tierswap" / "staging"
        assert not staging.exists() or not any(staging.iterdir())


@pytest.mark.parametrize("writer", list(WRITERS))
def test_sigkill_leaves_last_commit(tmp_path: Path, writer: str) -> None:
    _run(tmp_path / "store", kills=4, seed=1, writer=WRITERS[writer])


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(WRITERS))
def test_sigkill_stress(tmp_path: Path, writer: str) -> None:
    _run(tmp_path / "store", kills=30, seed=2, writer=WRITERS[writer])
