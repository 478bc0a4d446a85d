"""Optimizer snapshots: resume from any older snapshot bit-exact; state dicts by reference."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch

from tests.optim.models import TinyNet, batches, make_models, train_step
from tierswap.errors import ConfigError, NoCommitError, SnapshotExistsError
from tierswap.optim import SwapOptimizer

KW = {"lr": 1e-2, "weight_decay": 0.01}


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference_run(model: TinyNet, xs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters after every step of an uninterrupted plain AdamW run."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **KW)
    after = []
    for x in xs:
        train_step(model, opt, x)
        after.append(_params(model))
    return after


@pytest.mark.parametrize("host_budget", [None, 8192])
def test_resume_from_an_older_snapshot_is_bit_exact(tmp_path: Path, host_budget) -> None:
    model, start = make_models(seed=3)
    xs = batches(6)
    expected = _reference_run(start, xs)
    with SwapOptimizer(
        model.parameters(), swap_dir=tmp_path / "live", host_budget=host_budget, **KW
    ) as opt:
        for step, x in enumerate(xs, 1):
            train_step(model, opt, x)
            opt.snapshot(tmp_path / f"snap-{step}")
    for kept in (2, 4):  # not the newest
        _, fresh = make_models(seed=9)  # other weights: the snapshot's masters overwrite them
        with SwapOptimizer(
            fresh.parameters(),
            swap_dir=tmp_path / f"resumed-{kept}",
            resume_from=tmp_path / f"snap-{kept}",
            host_budget=host_budget,
            **KW,
        ) as resumed:
            assert resumed.steps == kept
            for got, want in zip(fresh.parameters(), expected[kept - 1], strict=True):
                assert torch.equal(got, want)
            for x in xs[kept:]:
                train_step(fresh, resumed, x)
        for got, want in zip(fresh.parameters(), expected[-1], strict=True):
            assert torch.equal(got, want)
        # the snapshot is still the step it was taken at
        with SwapOptimizer(
            TinyNet().parameters(),
            swap_dir=tmp_path / "check",
            resume_from=tmp_path / f"snap-{kept}",
            **KW,
        ) as again:
            assert again.steps == kept


def test_state_dict_by_reference_roundtrips_through_torch_save(tmp_path: Path) -> None:
    model, start = make_models(seed=4)
    xs = batches(5)
    expected = _reference_run(start, xs)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "live", **KW) as opt:
        for x in xs[:2]:
            train_step(model, opt, x)
        opt.redirect_state_dict(tmp_path / "ckpt" / "optimizer.tierswap")
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)  # what a trainer does
        assert len(buffer.getvalue()) < 2048  # a reference, not the state
        assert "state" in opt.state_dict()  # one call only: the next is torch's format again
        for x in xs[2:]:
            train_step(model, opt, x)
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        opt.load_state_dict(saved)  # back to step 2, in the same optimizer
        assert opt.steps == 2
        for x in xs[2:]:
            train_step(model, opt, x)
    for got, want in zip(model.parameters(), expected[-1], strict=True):
        assert torch.equal(got, want)


def test_load_snapshot_into_a_temporary_swap_folder(tmp_path: Path) -> None:
    model, start = make_models(seed=5)
    xs = batches(4)
    expected = _reference_run(start, xs)
    with SwapOptimizer(model.parameters(), **KW) as opt:
        train_step(model, opt, xs[0])
        opt.snapshot(tmp_path / "snap")
        temporary = opt.swap_dir
        train_step(model, opt, xs[1])
        opt.load_snapshot(tmp_path / "snap")
        assert opt.swap_dir == temporary
        for x in xs[1:]:
            train_step(model, opt, x)
    assert not temporary.exists()  # still removed at close
    for got, want in zip(model.parameters(), expected[-1], strict=True):
        assert torch.equal(got, want)


def test_snapshot_errors(tmp_path: Path) -> None:
    model, _ = make_models()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "live", **KW) as opt:
        with pytest.raises(SnapshotExistsError):
            opt.snapshot(tmp_path / "full")
        with pytest.raises(ConfigError, match="gone"):
            opt.load_state_dict(
                {"tierswap_snapshot": {"path": str(tmp_path / "nope"), "format": 1}}
            )
        with pytest.raises(ConfigError, match="no snapshot"):
            opt.load_snapshot(tmp_path / "nope")
        assert opt.steps == 0
    with pytest.raises(ConfigError, match="swap_dir"):
        SwapOptimizer(model.parameters(), resume_from=tmp_path / "live", **KW)
    from tierswap.store import SwapStore

    SwapStore(tmp_path / "empty").close()
    with pytest.raises(NoCommitError):
        SwapStore(tmp_path / "empty", mode="r").snapshot(tmp_path / "s")


def test_snapshot_commits_only_when_the_last_commit_is_stale(tmp_path: Path) -> None:
    model, _ = make_models()
    xs = batches(2)
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "live", **KW) as opt:
        train_step(model, opt, xs[0])  # "auto" commits the first step
        opt.synchronize()  # which waits for that commit, had it ended behind
        store = opt._backend.store
        generation = store.generation
        opt.snapshot(tmp_path / "a")
        assert store.generation == generation  # no commit: the snapshot wrote no data
        opt.load_state_dict(opt.state_dict())  # state changed outside step()
        opt.snapshot(tmp_path / "b")
        assert store.generation == generation + 1
    with SwapOptimizer(
        model.parameters(), swap_dir=tmp_path / "live2", commit_every=0, **KW
    ) as opt:
        train_step(model, opt, xs[1])
        assert opt._backend.committed_meta() is None
        assert opt.snapshot(tmp_path / "c").generation == 1
