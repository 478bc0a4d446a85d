"""Accelerate with a SwapOptimizer: ``save_state`` checkpoints whose optimizer is a snapshot.

    python examples/accelerate_loop.py --swap-dir swap/accelerate --steps 20 --save-every 5
    python examples/accelerate_loop.py --swap-dir swap/accelerate2 --steps 20 --save-every 5 \\
        --resume acc-output/checkpoints/checkpoint_1

Each checkpoint holds ``optimizer.tierswap/`` (hard links to the swap folder's commit) and a tiny
``optimizer.bin`` referencing it; ``total_limit`` keeps the newest few. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import tierswap as ts
from tierswap.integrations.accelerate import snapshot_checkpoints


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


class StepCounter:
    """Steps done, saved with each checkpoint (``accelerator.register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


def train(
    swap_dir: str | Path | None,
    *,
    steps: int,
    output_dir: str | Path,
    save_every: int = 0,
    total_limit: int | None = None,
    resume: str | Path | None = None,
    host_budget: str = "64KiB",
) -> torch.nn.Module:
    """Train with a SwapOptimizer (plain AdamW when ``swap_dir`` is ``None``); checkpoint every
    ``save_every`` steps; ``resume`` is a checkpoint folder to continue from."""
    model = make_model()
    if swap_dir is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = ts.SwapOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2,
                               swap_dir=swap_dir, host_budget=host_budget)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    project = ProjectConfiguration(
        project_dir=str(output_dir), automatic_checkpoint_naming=True, total_limit=total_limit
    )
    accelerator = Accelerator(cpu=True, project_config=project)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    snapshot_checkpoints(accelerator)  # the one line tierswap needs
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    if resume is not None:
        accelerator.load_state(str(resume))
    data = batches(steps)
    for step in range(counter.steps, steps):
        x, y = data[step]
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        counter.steps = step + 1
        if save_every and (step + 1) % save_every == 0:
            accelerator.save_state()
    swap = getattr(opt, "optimizer", opt)
    if isinstance(swap, ts.SwapOptimizer):
        swap.close()
    return accelerator.unwrap_model(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap/accelerate")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--total-limit", type=int, default=2)
    parser.add_argument("--output-dir", default="swap/accelerate-output")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    args = parser.parse_args()
    model = train(args.swap_dir, steps=args.steps, output_dir=args.output_dir,
                  save_every=args.save_every, total_limit=args.total_limit,
                  resume=args.resume)  # fmt: skip
    print({"param_sum": float(sum(p.detach().sum() for p in model.parameters()))})


if __name__ == "__main__":
    main()
