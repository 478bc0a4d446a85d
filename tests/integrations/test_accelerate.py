"""Accelerate save_state / load_state with snapshot checkpoints: resume from an older one."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[hf])")

from tests.integrations.helpers import load_example
from tests.optim.models import assert_same_params


def _example():
    return load_example("accelerate_loop.py")


@pytest.mark.usefixtures("no_gathering")
def test_save_state_keeps_snapshots_and_resumes_bit_exact(tmp_path) -> None:
    example = _example()
    plain = example.train(None, steps=8, output_dir=tmp_path / "plain")
    out = tmp_path / "out"
    full = example.train(tmp_path / "swap", steps=8, output_dir=out, save_every=2, total_limit=2)
    assert_same_params(plain, full)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["checkpoint_2", "checkpoint_3"]  # steps 6 and 8; total_limit rotated
    older = out / "checkpoints" / "checkpoint_2"
    assert (older / "optimizer.bin").stat().st_size < 4096
    assert (older / "optimizer.tierswap" / "zarr.json").exists()
    # resume from the older retained checkpoint, moved elsewhere first: found via the hook
    moved = tmp_path / "moved"
    shutil.copytree(older, moved)
    shutil.rmtree(out)
    resumed = example.train(tmp_path / "swap2", steps=8, output_dir=tmp_path / "o2", resume=moved)
    assert_same_params(plain, resumed)
