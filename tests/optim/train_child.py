"""A training process for the kill-and-resume test: ``python -m tests.optim.train_child DIR``.

Trains TinyNet with a SwapOptimizer committing every step and prints ``committed <n>`` after
each step until it is killed.
"""

from __future__ import annotations

import sys

import torch

from tests.optim.models import batch_for_step, make_models, train_step
from tierswap.optim import SwapOptimizer

CHILD_KWARGS = {"host_budget": 8192, "lr": 1e-2, "weight_decay": 0.05}
CHILD_LR_DECAY = 0.9


def main(swap_dir: str) -> None:
    _, model = make_models()
    opt = SwapOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **CHILD_KWARGS)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=CHILD_LR_DECAY)
    step = 0
    while True:
        train_step(model, opt, batch_for_step(step))
        sched.step()
        step += 1
        print(f"committed {opt.steps}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
