"""Accelerate save_state / load_state with snapshot checkpoints: resume from an older one."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[hf])")

from tierswap.optim import _state_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("accelerate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_save_state_keeps_snapshots_and_resumes_bit_exact(tmp_path, monkeypatch) -> None:
    example = _example()
    plain = example.train(None, steps=8, output_dir=tmp_path / "plain")
    gather = _state_dict.state_dict

    def never_after_a_step(optimizer):  # accelerate round-trips the empty state at prepare()
        if optimizer.steps:
            raise AssertionError("a checkpoint gathered the optimizer state into RAM")
        return gather(optimizer)

    monkeypatch.setattr(_state_dict, "state_dict", never_after_a_step)
    out = tmp_path / "out"
    full = example.train(tmp_path / "swap", steps=8, output_dir=out, save_every=2, total_limit=2)
    _equal(plain, full)
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
    _equal(plain, resumed)
