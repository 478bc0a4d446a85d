"""A plain PyTorch training loop with its AdamW state swapped to disk: one changed line.

    python examples/plain_loop.py --swap-dir /tmp/plain-loop --steps 20

Run it again with ``--resume`` to continue from the last commit of the swap folder (the LR
schedule and the data restart: a real script restores them from its own checkpoint).
"""

from __future__ import annotations

import argparse

import torch

import tierswap as ts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap/plain-loop")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-budget", default="512KiB")  # state: ~660 KiB
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 1),
    )  # fmt: skip
    # The one changed line: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = ts.SwapOptimizer(
        model.named_parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01,
        swap_dir=args.swap_dir, host_budget=args.host_budget, resume=args.resume,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(args.steps):
            x = torch.randn(32, 64, generator=data)
            y = x.sum(dim=1, keepdim=True).sin()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # commits the swap folder when due (commit_every="auto")
            sched.step()
            print(f"step {opt.steps:4d}  loss {loss.item():.4f}")
        print("tier stats:", opt.tier_stats())


if __name__ == "__main__":
    main()
