"""Training GPT-2s in lock step, for the streaming tests that compare two of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Pair = tuple[torch.nn.Module, torch.optim.Optimizer]


def train_gpt2_lockstep(
    pairs: Sequence[Pair],
    steps: int,
    *,
    vocab: int = 97,
    after_step: Callable[[], None] | None = None,
) -> None:
    """``steps`` steps of each (model, optimizer) pair on the same random token batches
    (2 x 16), clipping at 0.5 with torch's ``clip_grad_norm_``; ``after_step`` runs after
    each step of every pair."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=gen)
        for model, opt in pairs:
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        if after_step is not None:
            after_step()
