"""tierswap demo: train a GPT-2-style model with its Adam state on disk, under a small budget.

    python examples/demo.py --swap-dir swap                 # ~110M params, a few steps
    python examples/demo.py --swap-dir swap --layers 24 --dim 1024 --steps 20   # bigger

The model is built from a config (no download). Its AdamW state (8 bytes per parameter) lives in
a tierswap swap folder with a host budget well below the state's size; the script prints tier
statistics and the step time against the same training with AdamW in memory, and checks that
both runs end with bit-identical parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import torch
from torch import nn
from torch.nn import functional

import tierswap as ts
from tierswap.config import format_size, parse_size


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 32000
    seq: int = 128
    dim: int = 768
    layers: int = 12
    heads: int = 12


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.fc, self.out = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's architecture (pre-norm blocks, learned positions, tied embeddings)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.dim), nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def _batches(cfg: GPTConfig, args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(cfg.vocab, (args.batch, cfg.seq), generator=gen) for _ in range(args.steps)
    ]


def _train(model: GPT, opt: torch.optim.Optimizer, data: list[torch.Tensor], label: str) -> dict:
    """Run the steps with a progress bar; return step and optimizer-step times."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}")]
    step_s, opt_s = [], []
    with Progress(*columns, TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{label:>9}", total=len(data), info="")
        for idx in data:
            start = time.perf_counter()
            opt.zero_grad()
            loss = model(idx)
            loss.backward()
            mid = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            step_s.append(end - start)
            opt_s.append(end - mid)
            bar.update(task, advance=1, info=f"loss {loss.item():.3f}  opt.step {end - mid:.2f}s")
    return {
        "step": statistics.median(step_s),
        "opt": statistics.median(opt_s),
        "opt_total": sum(opt_s),
    }


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap", help="folder of the swap store")
    parser.add_argument("--host-budget", default="256MiB", help="host tier budget")
    parser.add_argument("--device-budget", default="0", help="device tier budget (0: off)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-memory run")
    return parser.parse_args()


def _print_stats(stats: dict, state_bytes: int, budget: int, opt_seconds: float) -> None:
    print(f"\nAdam state {format_size(state_bytes)}, host budget {format_size(budget)}")
    for tier in ("device", "host"):
        tier_stats = stats.get(tier, {})
        if tier_stats.get("budget"):  # a tier with no budget holds nothing: not shown
            keys = ("hits", "misses", "used", "peak", "budget")
            shown = {k: v for k, v in tier_stats.items() if k in keys}
            print(f"  {tier:<6} {shown}")
    nvme = stats.get("nvme", {})
    print(
        f"  nvme   read {format_size(nvme.get('bytes_read', 0))}, "
        f"written {format_size(nvme.get('bytes_written', 0))}"
    )
    print(f"  stall  {stats.get('stall_seconds', 0.0):.2f} s")
    moved = nvme.get("bytes_read", 0) + nvme.get("bytes_written", 0)
    print(f"  disk traffic while stepping: {format_size(moved / opt_seconds)}/s "
          "(the swapped step is bound by this; compare `tierswap bench`)")  # fmt: skip


def main() -> None:
    args = _parse()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, layers=args.layers,
                    heads=max(1, args.dim // 64))  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {n_params / 1e6:.1f}M parameters, {cfg.layers} layers, dim {cfg.dim}")
    data = _batches(cfg, args)
    budget = parse_size(args.host_budget, name="--host-budget")
    opt = ts.SwapOptimizer(model.named_parameters(), torch.optim.AdamW, lr=3e-4, fused=True,
                           swap_dir=args.swap_dir, host_budget=budget, commit_every=0,
                           device_budget=args.device_budget)  # fmt: skip
    with opt:
        swapped = _train(model, opt, data, "tierswap")
        opt.commit()
        _print_stats(opt.tier_stats(), 8 * n_params, budget, swapped["opt_total"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"  peak RSS so far {format_size(rss)} (params + grads {format_size(8 * n_params)})")
    if args.no_baseline:
        return
    swapped_params = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(initial)
    memory = _train(
        model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), data, "in-memory"
    )
    same = all(torch.equal(a, b) for a, b in zip(swapped_params, model.parameters(), strict=True))
    print()
    for what, key in (("optimizer step", "opt"), ("training step", "step")):
        ratio = swapped[key] / memory[key]
        print(f"median {what:<15} tierswap {swapped[key]:.2f}s, in-memory {memory[key]:.2f}s "
              f"({ratio:.2f}x)")  # fmt: skip
    print(f"parameters bit-identical to in-memory AdamW: {same}")


if __name__ == "__main__":
    main()
