"""A training process for the kill-and-resume test: ``python -m tests.optim.train_child DIR
[muon]``.

Trains TinyNet with a SwapOptimizer committing every step and prints ``committed <n>`` after
each step until it is killed. With ``muon``, the matrices step with torch.optim.Muon and the
rest with AdamW, in one SwapOptimizer (:func:`muon_groups`).
"""

from __future__ import annotations

import sys

import torch

from tests.optim.models import batch_for_step, make_models, train_step
from tierswap.optim import SwapOptimizer

# commit_every=1: a kill at any step finds the commit of the step before it
CHILD_KWARGS = {"host_budget": 8192, "commit_every": 1, "lr": 1e-2, "weight_decay": 0.05}
CHILD_LR_DECAY = 0.9
MUON_LR = 0.02
MUON_KWARGS = {**CHILD_KWARGS, "host_budget": 64 << 10}  # whole matrices and their temporaries


def muon_groups(model: torch.nn.Module) -> list[dict[str, object]]:
    """Muon for the 2-D weights, the default class (AdamW) for the rest."""
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.dim() == 2]
    rest = [(n, p) for n, p in named if p.dim() != 2]
    return [
        {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices],
         "optimizer_class": torch.optim.Muon, "lr": MUON_LR},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]},
    ]  # fmt: skip


def main(swap_dir: str, recipe: str = "adamw") -> None:
    _, model = make_models()
    if recipe == "muon":
        opt = SwapOptimizer(muon_groups(model), torch.optim.AdamW, swap_dir=swap_dir, **MUON_KWARGS)
    else:
        opt = SwapOptimizer(
            model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **CHILD_KWARGS
        )
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=CHILD_LR_DECAY)
    step = 0
    while True:
        train_step(model, opt, batch_for_step(step))
        sched.step()
        step += 1
        print(f"committed {opt.steps}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
