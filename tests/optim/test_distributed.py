"""torch.distributed: per-rank swap folders, bitwise equality with plain optimizers, resume.

Two gloo processes on the CPU, talking over loopback only, run every scenario of
``dist_worker.py`` once (a module-scoped fixture); the tests compare what they saved.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tierswap
from tests.optim import dist_worker
from tierswap.errors import ConfigError, WorldSizeError
from tierswap.optim.distributed import check_world, rank_swap_dir, world, world_meta
from tierswap.store import SwapStore

WORLD_SIZE = 2
#: Generous for two processes on a loaded two-core machine; a hung process group fails here.
JOIN_TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(tmp: Path) -> None:
    """Run dist_worker.main on WORLD_SIZE ranks; kill them all if they outlive the timeout."""
    context = mp.start_processes(
        dist_worker.main,
        args=(WORLD_SIZE, _free_port(), str(tmp)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers still running after {JOIN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dist")
    _spawn(tmp)
    return {
        f"{name}{rank}": torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True) | {"tmp": tmp}
        for name in ("zero", "fsdp")
        for rank in range(WORLD_SIZE)
    }


def _assert_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"parameter {index} differs"


# -- DDP + ZeroRedundancyOptimizer -----------------------------------------------------------
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_zero_swapped_equals_plain(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"zero{rank}"]
    _assert_equal(run["swapped"], run["plain"])
    assert run["plain"][0].ne(dist_worker.make_model()[0].weight).any()  # it did train
    assert run["nvme"]["bytes_read"] > 0  # the host budget sent state through the disk
    assert run["owned"] == 3


def test_zero_each_rank_owns_a_folder(runs: dict[str, Any]) -> None:
    tmp = runs["zero0"]["tmp"]
    assert sorted(p.name for p in (tmp / "zero").iterdir()) == ["rank-0", "rank-1"]
    owned = 0
    for rank in range(WORLD_SIZE):
        assert runs[f"zero{rank}"]["swap_dir"] == str(tmp / "zero" / f"rank-{rank}")
        with SwapStore(tmp / "zero" / f"rank-{rank}", mode="r") as store:
            meta = store.meta["tierswap.optim"]
            assert (meta["rank"], meta["world_size"], meta["steps"]) == (rank, 2, 3)
            owned += len(meta["layout"])
        assert owned == sum(runs[f"zero{r}"]["owned"] for r in range(rank + 1))
    assert owned == len(list(dist_worker.make_model().parameters()))  # a partition of the model


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_zero_resume_per_rank(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"zero{rank}"]
    assert run["resumed_steps"] == dist_worker.STEPS - 1
    _assert_equal(run["resumed"], run["plain"])


# -- FSDP2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_swapped_equals_plain(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"fsdp{rank}"]
    _assert_equal(run["swapped"], run["plain"])
    assert run["nvme"]["bytes_read"] > 0
    assert run["swap_dir"] == str(run["tmp"] / "fsdp" / f"rank-{rank}")


def test_fsdp2_swaps_uneven_and_empty_shards(runs: dict[str, Any]) -> None:
    full = [p.numel() for p in dist_worker.make_model().parameters()]
    shards = [runs[f"fsdp{r}"]["shard_numels"] for r in range(WORLD_SIZE)]
    assert [a + b for a, b in zip(*shards, strict=True)] == full
    assert shards[1][-2:] == [0, 0]  # the 1-row layer: rank 1's shards are empty
    assert any(a != b for a, b in zip(*shards, strict=True))


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_state_dict_matches_plain(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"fsdp{rank}"]
    plain, swapped = run["plain_state"], run["swapped_state"]
    assert plain.keys() == swapped.keys()
    for index, state in plain.items():
        assert state.keys() == swapped[index].keys()
        for name, (is_dtensor, value) in state.items():
            assert swapped[index][name][0] == is_dtensor, (index, name)
            assert torch.equal(swapped[index][name][1], value), (index, name)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_resume_per_rank(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"fsdp{rank}"]
    assert run["resumed_steps"] == dist_worker.STEPS - 1
    _assert_equal(run["resumed"], run["plain"])


# -- world size --------------------------------------------------------------------------------
def _resume(swap_dir: Path) -> None:
    tierswap.SwapOptimizer(
        dist_worker.make_model().parameters(), swap_dir=swap_dir, resume=True, lr=1e-2
    ).close()


def test_resume_without_process_group_raises(runs: dict[str, Any]) -> None:
    folder = runs["fsdp1"]["tmp"] / "fsdp" / "rank-1"
    with pytest.raises(WorldSizeError, match=r"world_size=2 .* world_size=1"):
        _resume(folder)


def test_resume_with_other_world_size_raises(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-rank process group resuming the two-rank run finds rank-0 and refuses it."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert world() == (0, 1)
        swap_dir = runs["zero0"]["tmp"] / "zero"
        assert rank_swap_dir(swap_dir) == swap_dir / "rank-0"
        with pytest.raises(WorldSizeError, match="world_size=2") as info:
            _resume(swap_dir)
        assert isinstance(info.value, ConfigError)
    finally:
        dist.destroy_process_group()


def test_check_world_outside_a_process_group(tmp_path: Path) -> None:
    assert world_meta() == {"rank": 0, "world_size": 1}
    assert rank_swap_dir(tmp_path) == tmp_path
    check_world({"rank": 0, "world_size": 1}, tmp_path)
    check_world({}, tmp_path)  # commits from before world sizes were recorded
    with pytest.raises(WorldSizeError, match="rank 1 but this is rank 0"):
        check_world({"rank": 1, "world_size": 1}, tmp_path)
    with pytest.raises(WorldSizeError, match="world_size=4"):
        check_world({"rank": 0, "world_size": 4}, tmp_path)
