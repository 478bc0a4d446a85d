"""One rank of the two-process gloo runs in test_distributed.py (started with spawn).

Every scenario trains the same tiny model for a few steps on per-rank data and saves what the
test compares, as CPU tensors, to ``out/<scenario>-rank<r>.pt``. Swapped runs use a host budget
of a few pages, so the state goes through the NVMe tier every step.
"""

from __future__ import annotations

import datetime
import gc
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import tierswap
from tierswap.optim.distributed import broadcast_owned_params

STEPS = 3
#: Two 4 KiB pages: one small parameter's AdamW state; everything else waits on disk.
HOST_BUDGET = "8KiB"
LR = 1e-2


def make_model() -> torch.nn.Module:
    """Odd widths: FSDP2 shards unevenly, the last layer has empty shards on rank 1, and
    ZeRO gives each rank three parameters."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 7), torch.nn.Linear(7, 1)
    )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (torch's own ``to_local()``); any other tensor as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))


def train(model: torch.nn.Module, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [local_tensor(p).detach().clone() for p in model.parameters()]


# -- DDP + ZeroRedundancyOptimizer -------------------------------------------------------------
def _zero_class() -> type[Any]:
    # Importing torch.distributed.optim scripts torch's functional optimizers, which warns.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


def zero(
    swap_dir: Path | None, *, resume: bool = False, commit_every: int = 1, **swap_kwargs: Any
) -> tuple[Any, Any]:
    ZeroRedundancyOptimizer = _zero_class()
    model = DistributedDataParallel(make_model())
    if swap_dir is None:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    else:
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=tierswap.swapped(torch.optim.AdamW),
            swap_dir=swap_dir,
            host_budget=HOST_BUDGET,
            commit_every=commit_every,
            resume=resume,
            lr=LR,
            **swap_kwargs,
        )
    return model, opt


def copy_params(model: torch.nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(model.parameters(), values, strict=True):
            local_tensor(param).copy_(value)


def consolidated(opt: Any) -> dict[str, Any]:
    """ZeRO's full state dict (gathered on rank 0), then handed to every rank."""
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)
    return full[0]


def zero_scenarios(rank: int, tmp: Path) -> dict[str, Any]:
    model, opt = zero(None)
    train(model, opt, rank, range(STEPS))
    plain = local_params(model)

    model, opt = zero(tmp / "zero")
    train(model, opt, rank, range(STEPS))
    swapped = local_params(model)
    info = {"swap_dir": str(opt.optim.swap_dir), "nvme": opt.optim.tier_stats()["nvme"]}
    info["owned"] = sum(len(g["params"]) for g in opt.optim.param_groups)
    opt.optim.close()

    model, opt = zero(tmp / "zero-resume")
    train(model, opt, rank, range(STEPS - 1))
    checkpoint, params = consolidated(opt), local_params(model)
    opt.optim.close()  # as if killed after the last commit
    model, opt = zero(tmp / "zero-resume", resume=True)
    broadcast_owned_params(opt)
    info["resumed_steps"] = opt.optim.steps
    train(model, opt, rank, range(STEPS - 1, STEPS))
    resumed = local_params(model)
    opt.optim.close()

    # torch's own checkpoint path: ZeRO's load_state_dict writes the local optimizer's .state
    model, opt = zero(tmp / "zero-load")
    copy_params(model, params)
    opt.load_state_dict(checkpoint)
    train(model, opt, rank, range(STEPS - 1, STEPS))
    loaded = local_params(model)
    opt.optim.close()

    # per-rank snapshots of one step; the live run goes on, a new run starts from them
    model, opt = zero(tmp / "zero-live")
    train(model, opt, rank, range(STEPS - 1))
    opt.optim.snapshot(tmp / "zero-snap")  # a collective: zero-snap/rank-<r> on every rank
    train(model, opt, rank, range(STEPS - 1, STEPS))
    opt.optim.close()
    model, opt = zero(tmp / "zero-from-snap", resume_from=tmp / "zero-snap")
    broadcast_owned_params(opt)
    info["snapshot_steps"] = opt.optim.steps
    train(model, opt, rank, range(STEPS - 1, STEPS))
    from_snapshot = local_params(model)
    opt.optim.close()
    return {
        "plain": plain, "swapped": swapped, "resumed": resumed, "loaded": loaded,
        "from_snapshot": from_snapshot, **info,
    }  # fmt: skip


# -- FSDP2 -------------------------------------------------------------------------------------
def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def fsdp(
    swap_dir: Path | None, *, resume: bool = False, commit_every: int = 1, **swap_kwargs: Any
) -> tuple[torch.nn.Module, Any]:
    model = shard(make_model())
    if swap_dir is None:
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    return model, tierswap.SwapOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        swap_dir=swap_dir,
        host_budget=HOST_BUDGET,
        resume=resume,
        commit_every=commit_every,
        lr=LR,
        **swap_kwargs,
    )


def state_locals(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The state dict's per-parameter state as (is DTensor, local CPU tensor) pairs."""
    return {
        index: {
            name: (isinstance(value, DTensor), local_tensor(value).detach().clone())
            for name, value in state.items()
        }
        for index, state in opt.state_dict()["state"].items()
    }


def save_dcp(model: torch.nn.Module, opt: Any, path: Path) -> None:
    """torch.distributed.checkpoint of model and optimizer: each rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_dcp(model: torch.nn.Module, opt: Any, path: Path) -> None:
    """Load a checkpoint of :func:`save_dcp`, resharded to this run's world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def overlap_backward(rank: int, swap_dir: Path) -> tuple[list[torch.Tensor], bool]:
    """overlap="backward": FSDP2 runs the post-accumulate-grad hooks after its reduce-scatter."""
    model, opt = fsdp(swap_dir, overlap="backward")
    stepped_in_hooks = True
    for step in range(STEPS):
        model(batch(rank, step)).square().mean().backward()
        opt.synchronize()  # the hooks handed the slices to the worker, which steps them
        stepped_in_hooks &= all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    params = local_params(model)
    opt.close()
    return params, stepped_in_hooks


def bf16_masters(rank: int, swap_dir: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """bf16 FSDP2 params: SwapOptimizer keeps fp32 masters of the local shards. Reference: plain
    AdamW over hand-made fp32 master DTensors, cast back into the bf16 params each step."""
    model = shard(make_model().to(torch.bfloat16))
    opt = tierswap.SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, host_budget="16KiB", lr=LR
    )
    ref = shard(make_model().to(torch.bfloat16))
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=LR)
    for step in range(STEPS):
        for m in (model, ref):
            m(batch(rank, step).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        for master, param in zip(masters, ref.parameters(), strict=True):
            master.grad = param.grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters, ref.parameters(), strict=True):
                param.copy_(master)
                param.grad = None
    swapped = local_params(model)
    opt.close()
    return swapped, local_params(ref)


def skewed_resume(rank: int, swap_dir: Path) -> str:
    """Rank 0 commits step 2, rank 1 only step 1 (a kill between commits); resume both."""
    model, opt = fsdp(swap_dir, commit_every=0)
    train(model, opt, rank, range(1))
    opt.commit()
    train(model, opt, rank, range(1, 2))
    if rank == 0:
        opt.commit()
        opt.close()
    else:  # killed: released without close(), whose final commit would save step 2
        opt._finalizer()
    try:
        fsdp(swap_dir, resume=True)[1].close()
    except tierswap.errors.InconsistentResumeError as exc:
        return str(exc)
    return "resumed"


def fsdp_scenarios(rank: int, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = fsdp(None)
    train(model, opt, rank, range(STEPS))
    plain, plain_state = local_params(model), state_locals(opt)

    model, opt = fsdp(tmp / "fsdp")
    train(model, opt, rank, range(STEPS))
    swapped, swapped_state = local_params(model), state_locals(opt)
    info = {"swap_dir": str(opt.swap_dir), "nvme": opt.tier_stats()["nvme"]}
    info["shard_numels"] = [local_tensor(p).numel() for p in model.parameters()]
    opt.close()

    model, opt = fsdp(tmp / "fsdp-resume")
    train(model, opt, rank, range(STEPS - 1))
    checkpoint, params = get_optimizer_state_dict(model, opt), local_params(model)
    info["steps_after_get"] = opt.steps  # DCP must not take a zero-gradient step
    info["state_at_get"], info["params_at_get"] = state_locals(opt), params
    save_dcp(model, opt, tmp / "fsdp-dcp")  # for the test that reshards it onto one rank
    opt.close()
    model, opt = fsdp(tmp / "fsdp-resume", resume=True)
    info["resumed_steps"] = opt.steps
    train(model, opt, rank, range(STEPS - 1, STEPS))
    resumed = local_params(model)
    opt.close()

    # torch.distributed.checkpoint's state dicts, into a fresh swap folder
    model, opt = fsdp(tmp / "fsdp-load")
    copy_params(model, params)
    set_optimizer_state_dict(model, opt, checkpoint)
    train(model, opt, rank, range(STEPS - 1, STEPS))
    loaded = local_params(model)
    opt.close()
    info["skewed_resume"] = skewed_resume(rank, tmp / "fsdp-skewed")
    info["bf16"], info["bf16_reference"] = bf16_masters(rank, tmp / "fsdp-bf16")
    info["overlap"], info["stepped_in_hooks"] = overlap_backward(rank, tmp / "fsdp-overlap")
    return {
        "plain": plain,
        "swapped": swapped,
        "resumed": resumed,
        "loaded": loaded,
        "plain_state": plain_state,
        "swapped_state": swapped_state,
        **info,
    }


def main(rank: int, world_size: int, port: int, tmp: str) -> None:
    """Entry point of one spawned rank."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),  # a lost peer fails instead of hanging
    )
    try:
        out = Path(tmp)
        torch.save(zero_scenarios(rank, out), out / f"zero-rank{rank}.pt")
        torch.save(fsdp_scenarios(rank, out), out / f"fsdp-rank{rank}.pt")
    finally:
        gc.collect()  # free DDP / ZeRO / FSDP objects holding the group before destroying it
        dist.destroy_process_group()
