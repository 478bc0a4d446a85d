"""The Hugging Face Trainer example on a tiny config: plain AdamW's parameters, stats logged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[hf])")

from tierswap.integrations.hf import TierswapCallback, find_swap_optimizer, flatten_stats
from tierswap.optim import SwapOptimizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
TINY = {"layers": 2, "dim": 64, "vocab": 512, "seq": 32}


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_with_swap_optimizer_matches_plain_adamw(tmp_path) -> None:
    example = _example()
    _, plain_model = example.train(None, steps=3, output_dir=tmp_path / "a", model_kwargs=TINY)
    swap, swap_model = example.train(
        tmp_path / "swap", steps=3, output_dir=tmp_path / "b", host_budget="256KiB",
        model_kwargs=TINY,
    )  # fmt: skip
    opt = find_swap_optimizer(swap.optimizer)
    assert isinstance(opt, SwapOptimizer)
    try:
        for a, b in zip(plain_model.parameters(), swap_model.parameters(), strict=True):
            assert torch.equal(a, b)
        logged = [entry for entry in swap.state.log_history if "loss" in entry]
        assert len(logged) == 3
        assert logged[-1]["tierswap/optimizer_steps"] == 3.0
        assert "tierswap/nvme_bytes_read" in logged[-1]
        assert logged[-1]["tierswap/nvme_bytes_written"] > 0  # the budget sends state to disk
    finally:
        opt.close()


def test_flatten_stats_keeps_numbers_only() -> None:
    flat = flatten_stats({"host": {"hits": 2, "name": "x"}, "stall_seconds": 0.5, "on": True})
    assert flat == {"tierswap/host_hits": 2.0, "tierswap/stall_seconds": 0.5}


def test_callback_commits_on_save(tmp_path) -> None:
    model = torch.nn.Linear(4, 4)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=0) as opt:
        committed = []
        opt.commit = lambda: committed.append(True)
        TierswapCallback().on_save(None, None, None, optimizer=opt)
        assert committed == [True]
