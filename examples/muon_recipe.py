"""Muon for the hidden matrices, AdamW for the rest: one SwapOptimizer, state on disk.

    python examples/muon_recipe.py --swap-dir /tmp/muon-recipe --steps 20

The param group of the hidden matrices names its own optimizer class; every other group steps
with the class given to SwapOptimizer. Muon's math spans each matrix (Newton-Schulz), so its
parameters stream whole, never cut; the run is checked bit for bit against torch's Muon and
AdamW in memory. A SwapOptimizer is one optimizer, as the HF Trainer
(``optimizers=(opt, None)``) and Lightning's ``configure_optimizers`` expect.
"""

from __future__ import annotations

import argparse
import copy

import torch

import tierswap as ts


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_model(vocab: int, dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [Block(dim) for _ in range(layers)]
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *blocks, torch.nn.Linear(dim, vocab))


def recipe_groups(model: torch.nn.Module, muon_lr: float) -> list[dict]:
    """Muon for the 2-D weights inside the blocks; embedding, head, norms and biases: AdamW."""
    hidden, rest = [], []
    for name, param in model.named_parameters():
        inside = not name.startswith(("0.", f"{len(model) - 1}."))
        (hidden if inside and param.dim() == 2 else rest).append((name, param))
    return [
        {"params": [p for _, p in hidden], "param_names": [n for n, _ in hidden],
         "optimizer_class": torch.optim.Muon, "lr": muon_lr},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap/muon-recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--host-budget", default="512KiB")
    args = parser.parse_args()

    model = make_model(args.vocab, args.dim, args.layers)
    ref_model = copy.deepcopy(model)
    opt = ts.SwapOptimizer(
        recipe_groups(model, muon_lr=0.02), torch.optim.AdamW, lr=3e-3, weight_decay=0.01,
        swap_dir=args.swap_dir, host_budget=args.host_budget,
    )  # fmt: skip
    ref_groups = recipe_groups(ref_model, muon_lr=0.02)
    ref_muon = torch.optim.Muon(ref_groups[0]["params"], lr=0.02)
    ref_adamw = torch.optim.AdamW(ref_groups[1]["params"], lr=3e-3, weight_decay=0.01)
    data = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(args.steps):
            tokens = torch.randint(args.vocab, (8, 17), generator=data)
            for net, optimizers in ((model, [opt]), (ref_model, [ref_muon, ref_adamw])):
                logits = net(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)
                )
                for o in optimizers:
                    o.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                for o in optimizers:
                    o.step()
            print(f"step {opt.steps:4d}  loss {loss.item():.4f}")
        pairs = zip(model.parameters(), ref_model.parameters(), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
        print(f"slices: {len(opt.slices)}, muon matrices: {len(opt.param_groups[0]['params'])}")
        print(f"parameters bit-identical to in-memory Muon + AdamW: {same}")


if __name__ == "__main__":
    main()
