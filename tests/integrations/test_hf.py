"""The Hugging Face Trainer example on a tiny config: plain AdamW's parameters, stats logged."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[hf])")

from tests.integrations.helpers import load_example
from tierswap.integrations.hf import (
    SNAPSHOT_DIR,
    TierswapCallback,
    find_swap_optimizer,
    flatten_stats,
)
from tierswap.optim import SwapOptimizer

TINY = {"layers": 2, "dim": 64, "vocab": 512, "seq": 32}


def _example():
    return load_example("hf_trainer.py")


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
        names = [name for name, _ in swap_model.named_parameters()]
        keys = set(opt._backend.store.keys())
        assert {f"{name}/exp_avg" for name in names} <= keys  # keys name the parameters
    finally:
        opt.close()


def test_trainer_streaming_muon_groups_matches_the_optimizer_that_does_not_stream(
    tmp_path,
) -> None:
    """Muon for the blocks' matrices beside AdamW (param groups, ``model=`` names the
    model) under the Trainer, with its clipping: equal to the same groups not streamed."""
    example = _example()
    run = {"steps": 3, "host_budget": "1MiB", "model_kwargs": TINY, "muon": True}
    plain, plain_model = example.train(tmp_path / "a", output_dir=tmp_path / "oa", **run)
    swap, swap_model = example.train(tmp_path / "b", output_dir=tmp_path / "ob", stream=True, **run)
    try:
        state = swap_model.state_dict()
        for name, value in plain_model.state_dict().items():
            assert torch.equal(state[name], value), name
    finally:
        find_swap_optimizer(plain.optimizer).close()
        find_swap_optimizer(swap.optimizer).close()


def test_trainer_streaming_parameters_matches_plain_adamw(tmp_path) -> None:
    """offload_parameters=True under the Trainer: its clipping (max_grad_norm=1.0, through
    Accelerate to torch's clip_grad_norm_) works on the gradients in the swap folder."""
    example = _example()
    _, plain_model = example.train(None, steps=3, output_dir=tmp_path / "a", model_kwargs=TINY)
    swap, swap_model = example.train(
        tmp_path / "swap", steps=3, output_dir=tmp_path / "b", host_budget="256KiB",
        model_kwargs=TINY, stream=True,
    )  # fmt: skip
    opt = find_swap_optimizer(swap.optimizer)
    assert isinstance(opt, SwapOptimizer)
    try:
        assert all(p.untyped_storage().nbytes() == 0 for p in swap_model.parameters())
        state = swap_model.state_dict()  # read from the swap folder
        for name, value in plain_model.state_dict().items():
            assert torch.equal(state[name], value), name
        logged = [entry for entry in swap.state.log_history if "loss" in entry]
        assert logged[-1]["tierswap/parameters_kept_grad_bytes"] > 0
        assert "grad_norm" in logged[-1]
    finally:
        opt.close()
    for a, b in zip(plain_model.parameters(), swap_model.parameters(), strict=True):
        assert torch.equal(a, b)


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


def _split_snapshot(snap: Path, live: Path) -> tuple[int, int]:
    """(bytes of the snapshot's private files, bytes it shares with ``live``) - asserting that
    every chunk file is the live folder's own file."""
    private = shared = 0
    for path in snap.rglob("*"):
        if not path.is_file():
            continue
        if path.name == "zarr.json":
            private += path.stat().st_size
        else:
            assert os.path.samefile(path, live / path.relative_to(snap)), path
            shared += path.stat().st_size
    return private, shared


@pytest.mark.parametrize("stream", [False, True])
def test_checkpoints_hold_snapshots_and_resume_bit_exact(
    tmp_path, monkeypatch, no_gathering, stream
) -> None:
    """With ``stream`` the parameters live in the swap folder too: the Trainer saves the model
    from its state dict (read from there), the snapshot holds them, and the resumed run reads
    them back."""
    example = _example()
    _, plain_model = example.train(None, steps=6, output_dir=tmp_path / "plain", model_kwargs=TINY)

    run = {
        "steps": 6, "host_budget": "256KiB", "model_kwargs": TINY, "save_steps": 2,
        "stream": stream,
    }  # fmt: skip
    full, full_model = example.train(
        tmp_path / "swap", output_dir=tmp_path / "out", save_total_limit=2, **run
    )
    opt = find_swap_optimizer(full.optimizer)
    try:
        kept = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
        assert kept == ["checkpoint-4", "checkpoint-6"]  # save_total_limit rotated checkpoint-2
        newest = tmp_path / "out" / "checkpoint-6"
        private, shared = _split_snapshot(newest / SNAPSHOT_DIR, opt.swap_dir)
        written = private + (newest / "optimizer.pt").stat().st_size
        assert written < 0.1 * shared  # the state itself was never written again
    finally:
        opt.close()
    for a, b in zip(plain_model.parameters(), full_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # resume from the older retained checkpoint, into a fresh swap folder and the same output
    loaded = []
    load_snapshot = SwapOptimizer.load_snapshot
    monkeypatch.setattr(
        SwapOptimizer, "load_snapshot", lambda o, p: (loaded.append(o.steps), load_snapshot(o, p))
    )
    resumed, resumed_model = example.train(
        tmp_path / "swap2", output_dir=tmp_path / "out", save_total_limit=2,
        resume=tmp_path / "out" / "checkpoint-4", **run,
    )  # fmt: skip
    assert loaded == [0]  # the reference in checkpoint-4/optimizer.pt was loaded, at step 0
    resumed_opt = find_swap_optimizer(resumed.optimizer)
    assert resumed_opt.steps == 6
    resumed_opt.close()
    for a, b in zip(plain_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_callback_without_optimizer_save_only_commits(tmp_path) -> None:
    model = torch.nn.Linear(4, 4)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    state = SimpleNamespace(global_step=3)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=0) as opt:
        callback = TierswapCallback()
        callback.on_step_end(args, state, SimpleNamespace(should_save=True), optimizer=opt)
        callback.on_save(args, state, None, optimizer=opt)  # save_only_model: no state_dict()
        assert "state" in opt.state_dict()  # disarmed: torch's own format again
        assert opt._backend.store.generation == 1
    assert not (tmp_path / "out").exists()


def test_find_swap_optimizer_stays_importable_from_the_hf_module() -> None:
    import tierswap.optim

    assert find_swap_optimizer is tierswap.optim.find_swap_optimizer


def test_muon_recipe_checkpoints_and_resumes_bit_exact(tmp_path, no_gathering) -> None:
    """Muon for the blocks' matrices beside AdamW, one optimizer as the Trainer takes."""
    example = _example()
    run = {"steps": 4, "host_budget": "1MiB", "model_kwargs": TINY, "muon": True, "save_steps": 2}
    full, full_model = example.train(tmp_path / "swap", output_dir=tmp_path / "out", **run)
    opt = find_swap_optimizer(full.optimizer)
    assert opt.param_groups[0]["optimizer_class"] is torch.optim.Muon
    assert len(opt.slices) > 1
    opt.close()
    resumed, resumed_model = example.train(
        tmp_path / "swap2", output_dir=tmp_path / "out",
        resume=tmp_path / "out" / "checkpoint-2", **run,
    )  # fmt: skip
    resumed_opt = find_swap_optimizer(resumed.optimizer)
    assert resumed_opt.steps == 4
    resumed_opt.close()
    for a, b in zip(full_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
