"""Data-parallel training with each rank's optimizer state swapped to its own local folder.

    torchrun --nproc-per-node 2 examples/distributed.py --mode zero --swap-dir /tmp/dist-swap
    torchrun --nproc-per-node 2 examples/distributed.py --mode fsdp --swap-dir /tmp/dist-swap

``--mode zero``: DDP with torch's ``ZeroRedundancyOptimizer``; each rank owns the AdamW state of
its partition of the parameters. ``--mode fsdp``: FSDP2 ``fully_shard``; each rank owns the state
of its local shards. Either way rank ``r`` swaps to ``<swap-dir>/rank-<r>`` and torch does all the
communication. Run the same command again with ``--resume`` (and the same number of processes)
to continue from the last commit. Uses NCCL and one GPU per rank when CUDA is available, gloo on
the CPU otherwise.
"""

from __future__ import annotations

import argparse
import gc
import os
import warnings

import torch
import torch.distributed as dist

import tierswap as ts
from tierswap.optim.distributed import broadcast_owned_params


def make_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 1),
    ).to(device)  # fmt: skip


def zero_setup(model: torch.nn.Module, args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    """DDP replicas; ZeroRedundancyOptimizer builds a swapped AdamW over this rank's partition."""
    with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=ts.swapped(torch.optim.AdamW),
        swap_dir=args.swap_dir,  # this rank's state goes to swap_dir/rank-<r>
        host_budget=args.host_budget,
        resume=args.resume,
        lr=1e-3,
    )
    if args.resume:
        broadcast_owned_params(opt)  # each rank restored only the parameters it owns
    return ddp, opt


def fsdp_setup(model: torch.nn.Module, args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    """FSDP2 shards every Linear; SwapOptimizer swaps this rank's local shards."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = ts.SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-3,
        swap_dir=args.swap_dir, host_budget=args.host_budget, resume=args.resume,
    )  # fmt: skip
    return model, opt


def swap_optimizer(opt: object) -> ts.SwapOptimizer:
    return opt.optim if hasattr(opt, "optim") else opt  # ZeRO keeps the local one in .optim


def train(model: torch.nn.Module, opt: object, args: argparse.Namespace, device: object) -> None:
    rank = dist.get_rank()
    local = swap_optimizer(opt)
    data = torch.Generator().manual_seed(1000 * rank + local.steps)  # different data per rank
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        opt.step()  # each rank steps its own state; commits its own folder
        opt.zero_grad()
        if rank == 0:
            print(f"step {local.steps:4d}  loss {loss.item():.4f}", flush=True)


def run(args: argparse.Namespace, device: torch.device) -> None:
    setup = zero_setup if args.mode == "zero" else fsdp_setup
    model, opt = setup(make_model(device), args)
    local = swap_optimizer(opt)
    try:
        train(model, opt, args, device)
        print(f"rank {dist.get_rank()}: {local.swap_dir}  {local.tier_stats()['nvme']}")
    finally:
        local.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("zero", "fsdp"), default="zero")
    parser.add_argument("--swap-dir", default="swap/distributed")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--host-budget", default="512KiB")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        run(args, device)
    finally:
        # DDP and ZeRO hold the process group; free them first, so the group's threads are
        # joined by destroy_process_group and not during interpreter shutdown.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
