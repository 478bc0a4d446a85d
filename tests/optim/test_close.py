"""close() commits the steps taken since the last commit, so resume=True continues from it."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.optim.models import assert_same_params, assert_same_state, batches, make_models
from tierswap.optim import SwapOptimizer
from tierswap.store import SwapStore


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _committed_steps(path: Path) -> int | None:
    with SwapStore(path, mode="r") as store:
        meta = (store.meta or {}).get("tierswap.optim")
    return None if meta is None else int(meta["steps"])


@pytest.mark.parametrize("commit_every", [0, 5])
def test_close_commits_the_steps_since_the_last_commit(tmp_path: Path, commit_every: int) -> None:
    reference, model = make_models()
    xs = batches(3)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, plain, xs)
    opt = SwapOptimizer(
        model.parameters(), lr=1e-2, swap_dir=tmp_path / "s", commit_every=commit_every,
        host_budget="16KiB",
    )  # fmt: skip
    _train(model, opt, xs)
    opt.close()
    assert _committed_steps(tmp_path / "s") == 3
    _, fresh = make_models(seed=5)  # a new process: parameters come from the folder
    with SwapOptimizer(
        fresh.parameters(), lr=1e-2, swap_dir=tmp_path / "s", host_budget="16KiB", resume=True
    ) as resumed:
        assert resumed.steps == 3
        assert_same_params(reference, fresh)
        assert_same_state(plain.state_dict(), resumed.state_dict())


def test_close_of_a_scratch_store_does_not_commit(tmp_path: Path) -> None:
    _, model = make_models()
    opt = SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=0, durable=False)
    _train(model, opt, batches(2))
    opt.close()
    assert _committed_steps(tmp_path / "s") is None


def test_close_after_a_failed_step_warns_and_keeps_the_last_commit(tmp_path: Path) -> None:
    _, model = make_models()
    opt = SwapOptimizer(
        model.parameters(), swap_dir=tmp_path / "s", commit_every=0, host_budget="16KiB"
    )
    _train(model, opt, batches(2))
    opt.commit()
    _train(model, opt, batches(1))

    def fail(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.EIO, "injected read error")

    model(batches(1)[0]).square().mean().backward()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SwapStore, "get_region_async", fail)
        with pytest.raises(OSError, match="injected"):
            opt.step()
    with pytest.warns(RuntimeWarning, match="not committed.*step 2"):
        opt.close()
    assert _committed_steps(tmp_path / "s") == 2  # half a step is never committed


def test_a_failing_final_commit_warns_and_still_releases_the_folder(tmp_path: Path) -> None:
    _, model = make_models()
    opt = SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=0)
    _train(model, opt, batches(2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SwapStore, "commit", lambda *a, **k: (_ for _ in ()).throw(OSError("full")))
        with pytest.warns(RuntimeWarning, match="could not commit.*full"):
            opt.close()
    with SwapStore(tmp_path / "s") as store:  # the lock was released
        assert store.meta is None or "tierswap.optim" not in store.meta


def test_close_without_steps_since_the_commit_writes_nothing(tmp_path: Path) -> None:
    _, model = make_models()
    with SwapOptimizer(model.parameters(), swap_dir=tmp_path / "s", commit_every=1) as opt:
        _train(model, opt, batches(2))
    with SwapStore(tmp_path / "s", mode="r") as store:
        assert store.generation == 2  # one commit per step, none at close
