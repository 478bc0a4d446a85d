"""Lightning checkpoints with snapshots: rotation, and resume from an older one, bit-exact."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (.[lightning])")

from tierswap.optim import _state_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_loop.py"
pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's own deprecation and tips


def _example():
    spec = importlib.util.spec_from_file_location("lightning_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_checkpoints_keep_snapshots_and_resume_bit_exact(tmp_path, monkeypatch) -> None:
    example = _example()
    plain = example.train(None, steps=8, output_dir=tmp_path / "plain", save_every=2)
    gather = _state_dict.state_dict

    def never_after_a_step(optimizer):
        if optimizer.steps:
            raise AssertionError("a checkpoint gathered the optimizer state into RAM")
        return gather(optimizer)

    monkeypatch.setattr(_state_dict, "state_dict", never_after_a_step)
    out = tmp_path / "out"
    full = example.train(tmp_path / "swap", steps=8, output_dir=out, save_every=2, save_top_k=2)
    _equal(plain, full)
    assert sorted(p.name for p in out.iterdir()) == [
        "step=6.ckpt", "step=6.ckpt.tierswap", "step=8.ckpt", "step=8.ckpt.tierswap",
    ]  # fmt: skip
    assert (out / "step=6.ckpt").stat().st_size < 64 << 10  # weights and a reference only
    # resume from the older retained checkpoint after moving the pair elsewhere
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(out / "step=6.ckpt", moved / "step=6.ckpt")
    shutil.move(out / "step=6.ckpt.tierswap", moved / "step=6.ckpt.tierswap")
    shutil.rmtree(out)
    resumed = example.train(
        tmp_path / "swap2", steps=8, output_dir=tmp_path / "o2", save_every=2,
        resume=moved / "step=6.ckpt",
    )  # fmt: skip
    _equal(plain, resumed)
