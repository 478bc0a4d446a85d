"""How often gradient clipping changes the gradients of the GPT-2 bench (issue 16, item 3).

    python bench/clip_rate.py [--steps 20] [--max-norm 1.0]

Stepping during backward with unclipped gradients (speculation) pays only if clipping rarely
changes them: every step whose total norm exceeds ``max_norm`` would redo every slice. This
trains ``bench/e2e.py``'s GPT-2 124M (random init, batch 4 x 64 tokens, AdamW lr 1e-4) in RAM
and prints the share of steps that clipping changed, with the norms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _e2e_child import GPT2_BATCH, GPT2_TOKENS, build_gpt2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-norm", type=float, default=1.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = build_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(args.steps):
        tokens = torch.randint(model.config.vocab_size, (GPT2_BATCH, GPT2_TOKENS), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)))
        opt.step()
    clipped = sum(norm > args.max_norm for norm in norms)
    print(
        f"clipping changed the gradients in {clipped} of {len(norms)} steps "
        f"(max_norm {args.max_norm}); total norm min {min(norms):.2f}, median "
        f"{statistics.median(norms):.2f}, max {max(norms):.2f}"
    )


if __name__ == "__main__":
    main()
