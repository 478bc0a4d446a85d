"""``SwapOptimizer(swap_dir=[A, B])``: the state striped over several folders, bit-exact steps,
resume, snapshots and per-rank folders."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.optim.models import assert_same_params, batches, make_models, train_step
from tierswap.optim import SwapOptimizer
from tierswap.optim.distributed import rank_swap_dir

KW = {"lr": 1e-2, "weight_decay": 0.01}


def _chunk_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("c/*") if ".tierswap" not in p.relative_to(folder).parts]


@pytest.mark.parametrize("host_budget", [None, 8192])
def test_state_on_several_folders_steps_like_adamw_and_resumes(
    tmp_path: Path, host_budget: int | None
) -> None:
    model, plain = make_models(seed=3)
    reference = torch.optim.AdamW(plain.parameters(), **KW)
    folders = [tmp_path / "nvme0" / "run", tmp_path / "nvme1" / "run"]
    xs = batches(6)
    with SwapOptimizer(model.parameters(), swap_dir=folders, host_budget=host_budget, **KW) as opt:
        assert opt._backend.store.paths == tuple(folders)
        for x in xs[:3]:
            train_step(model, opt, x)
            train_step(plain, reference, x)
        assert_same_params(model, plain)
    assert all(_chunk_files(folder) for folder in folders)  # the state is on both drives
    resumed_model = copy.deepcopy(plain)
    with SwapOptimizer(
        resumed_model.parameters(), swap_dir=folders, resume=True, host_budget=host_budget, **KW
    ) as resumed:
        assert resumed.steps == 3
        for x in xs[3:]:
            train_step(resumed_model, resumed, x)
            train_step(plain, reference, x)
    assert_same_params(resumed_model, plain)


def test_snapshot_of_several_folders_resumes_into_other_folders(tmp_path: Path) -> None:
    model, start = make_models(seed=4)
    xs = batches(4)
    folders = [tmp_path / "a" / "run", tmp_path / "b" / "run"]
    with SwapOptimizer(model.parameters(), swap_dir=folders, host_budget=8192, **KW) as opt:
        for x in xs[:2]:
            train_step(model, opt, x)
        opt.snapshot(tmp_path / "ckpt" / "optimizer.tierswap")  # one folder: a checkpoint's
        for x in xs[2:]:
            train_step(model, opt, x)
    snap = tmp_path / "ckpt" / "optimizer.tierswap"
    assert (snap / ".tierswap" / "folder-1").is_dir()
    replay = copy.deepcopy(start)
    reference = torch.optim.AdamW(replay.parameters(), **KW)
    for x in xs:
        train_step(replay, reference, x)
    _, fresh = make_models(seed=9)
    other = [tmp_path / "c" / "run", tmp_path / "d" / "run"]
    with SwapOptimizer(
        fresh.parameters(), swap_dir=other, resume_from=snap, host_budget=8192, **KW
    ) as resumed:
        assert resumed._backend.store.paths == tuple(other)
        assert resumed.steps == 2
        for x in xs[2:]:
            train_step(fresh, resumed, x)
    assert_same_params(fresh, replay)


def test_each_rank_swaps_to_its_own_folder_on_every_drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    folders = [tmp_path / "a", tmp_path / "b"]
    assert rank_swap_dir(folders) == folders  # outside a process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert rank_swap_dir(folders) == [tmp_path / "a" / "rank-0", tmp_path / "b" / "rank-0"]
        model, _ = make_models(seed=5)
        with SwapOptimizer(model.parameters(), swap_dir=folders, **KW) as opt:
            train_step(model, opt, batches(1)[0])
            assert opt._backend.store.paths == tuple(f / "rank-0" for f in folders)
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "b" / "rank-0" / ".tierswap" / "zarr.json").exists()
