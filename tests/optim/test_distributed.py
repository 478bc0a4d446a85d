"""torch.distributed: per-rank swap folders, bitwise equality with plain optimizers, resume.

Two gloo processes on the CPU, talking over loopback only, run every scenario of
``dist_worker.py`` once (a module-scoped fixture); the tests compare what they saved.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_zero_per_rank_snapshots_resume_bit_exact(runs: dict[str, Any], rank: int) -> None:
    """Each rank snapshots its folder into snap/rank-<r> at one step; a new run from them ends
    where the uninterrupted run does, and the snapshots are standalone stores."""
    run = runs[f"zero{rank}"]
    assert run["snapshot_steps"] == dist_worker.STEPS - 1
    _assert_equal(run["from_snapshot"], run["plain"])
    snap = run["tmp"] / "zero-snap" / f"rank-{rank}"
    with SwapStore(snap, mode="r") as store:
        meta = store.meta["tierswap.optim"]
        assert (meta["rank"], meta["steps"]) == (rank, dist_worker.STEPS - 1)
        assert store.verify() == []


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_zero_load_state_dict_into_swapped(runs: dict[str, Any], rank: int) -> None:
    """consolidate_state_dict + load_state_dict, torch's ZeRO checkpoint, reaches the swap."""
    _assert_equal(runs[f"zero{rank}"]["loaded"], runs[f"zero{rank}"]["plain"])


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


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_distributed_checkpoint_state_dict(runs: dict[str, Any], rank: int) -> None:
    """get/set_optimizer_state_dict round trip; getting it takes no zero-gradient step."""
    run = runs[f"fsdp{rank}"]
    assert run["steps_after_get"] == dist_worker.STEPS - 1
    _assert_equal(run["loaded"], run["plain"])


def _cat_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    return shards[0] if shards[0].dim() == 0 else torch.cat(shards)


def test_fsdp2_reshards_through_dcp_onto_one_rank(
    runs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another world size: a torch.distributed.checkpoint of the two-rank run, loaded on one."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, opt = dist_worker.fsdp(tmp_path / "one-rank")
        dist_worker.load_dcp(model, opt, runs["fsdp0"]["tmp"] / "fsdp-dcp")
        saved = [runs[f"fsdp{r}"] for r in range(WORLD_SIZE)]
        for index, param in enumerate(dist_worker.local_params(model)):
            assert torch.equal(param, _cat_shards([s["params_at_get"][index] for s in saved]))
        for index, state in dist_worker.state_locals(opt).items():
            for name, (_, value) in state.items():
                shards = [s["state_at_get"][index][name][1] for s in saved]
                assert torch.equal(value, _cat_shards(shards)), (index, name)
        dist_worker.train(model, opt, 0, range(dist_worker.STEPS - 1, dist_worker.STEPS))
        opt.close()
        with SwapStore(tmp_path / "one-rank" / "rank-0", mode="r") as store:
            assert store.meta["tierswap.optim"]["world_size"] == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_bf16_params_keep_fp32_masters_of_the_shards(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"fsdp{rank}"]
    assert all(p.dtype == torch.bfloat16 for p in run["bf16"])
    _assert_equal(run["bf16"], run["bf16_reference"])


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fsdp2_overlap_backward_steps_in_hooks(runs: dict[str, Any], rank: int) -> None:
    run = runs[f"fsdp{rank}"]
    assert run["stepped_in_hooks"]
    _assert_equal(run["overlap"], run["plain"])


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_resume_of_folders_at_different_steps_raises_on_every_rank(
    runs: dict[str, Any], rank: int
) -> None:
    message = runs[f"fsdp{rank}"]["skewed_resume"]
    assert "rank 0: 2, rank 1: 1" in message
    assert f"rank-{rank}" in message


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


# -- the optimizer's .state, as torch.distributed sees it ---------------------------------------
def test_state_is_true_once_the_swap_space_holds_state(tmp_path: Path) -> None:
    """torch.distributed.checkpoint steps an optimizer whose ``state`` is false."""
    model = dist_worker.make_model()
    with tierswap.SwapOptimizer(model.parameters(), swap_dir=tmp_path, lr=1e-2) as opt:
        assert not opt.state
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        assert opt.state
        assert len(opt.state) == 0  # the tensors themselves stay in the swap space


def test_state_written_directly_is_adopted(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer.load_state_dict assigns ``optim.state[param]`` itself."""
    model = dist_worker.make_model()
    plain_model = dist_worker.make_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain_model(torch.ones(2, 8)).sum().backward()
    plain.step()
    plain.zero_grad()
    with tierswap.SwapOptimizer(model.parameters(), swap_dir=tmp_path, lr=1e-2) as opt:
        model.load_state_dict(plain_model.state_dict())
        for param, plain_param in zip(model.parameters(), plain_model.parameters(), strict=True):
            opt.state[param] = {k: v.clone() for k, v in plain.state[plain_param].items()}
        for m in (model, plain_model):
            m(torch.full((2, 8), 0.5)).sum().backward()
        opt.step()
        plain.step()
        assert len(opt.state) == 0
        _assert_equal(list(model.parameters()), list(plain_model.parameters()))
        opt.state[torch.zeros(3)] = {}
        with pytest.raises(ConfigError, match="not one of this optimizer's parameters"):
            opt.step()


# -- the example, as the docs tell users to run it ---------------------------------------------
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "distributed.py"


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(EXAMPLE), *args,
    ]  # fmt: skip
    root = str(EXAMPLE.parents[1])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("mode", ["zero", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_example_trains_and_resumes_under_torchrun(tmp_path: Path, mode: str) -> None:
    common = ("--mode", mode, "--swap-dir", str(tmp_path), "--steps", "2")
    first = _torchrun(*common)
    assert "step    2" in first.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-1"]
    second = _torchrun(*common, "--resume")
    assert "step    4" in second.stdout
    assert "step    1" not in second.stdout
