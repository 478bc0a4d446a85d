"""Benchmark: disk bytes per parameter of one steady step with compact state, at a small budget.

    PYTHONPATH=. python bench/compact_reads.py [--budget 1MiB] [--precision 8bit] [--steps 3]

A 1.3M-parameter fp32 MLP (Linear 256->1024, 1024->1024, 1024->16) steps with AdamW, its state
swapped (``commit_every=0``, nothing resident at the default 1 MiB host budget), so slices are
small. After a first step (which creates the state) and a drain, each further step's disk
traffic (``tier_stats()["nvme"]``, the store's bytes) is divided by the parameter count. The
format's own size is the floor: ``2 * (1 + 4/256) = 2.03`` bytes per parameter for 8-bit
moments (codes and one fp32 scale per block of 256), 4 for bf16, 8 for fp32, plus the fp32
state of the tensors too small for 8 bits (the biases). Also prints what the host tier holds
after the steps against its budget, and the bytes of 8-bit scales the layout holds in host
memory (``Layout.held_scales``: read once, written by commits). Results go to stdout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tierswap as ts  # noqa: E402
from tierswap.optim.formats import bytes_per_element  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.Tanh(),
        torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
        torch.nn.Linear(1024, 16),
    )  # fmt: skip


def measure(budget: str, precision: str, steps: int) -> dict[str, float]:
    """Median bytes read and written per parameter over ``steps`` steady steps."""
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(64, 256)
    reads: list[float] = []
    writes: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        opt = ts.SwapOptimizer(
            model.named_parameters(), torch.optim.AdamW, lr=1e-3, swap_dir=Path(folder) / "s",
            host_budget=budget, state_precision=precision, commit_every=0,
        )  # fmt: skip
        try:
            for step in range(steps + 1):
                before = opt.tier_stats()["nvme"]
                model(x).square().mean().backward()  # the hooks start the step's reads
                opt.step()
                opt.zero_grad()
                opt._backend.pipeline.drain()
                after = opt.tier_stats()["nvme"]
                if step:
                    reads.append((after["bytes_read"] - before["bytes_read"]) / numel)
                    writes.append((after["bytes_written"] - before["bytes_written"]) / numel)
            host = opt.tier_stats()["host"]
            resident = len(opt.placement)
            held_scales = opt._layout.held_scales
            largest = max(seg.numel for piece in opt._layout.slices for seg in piece.segments)
        finally:
            opt.close()
    return {
        "params": numel,
        "read": sorted(reads)[len(reads) // 2],
        "written": sorted(writes)[len(writes) // 2],
        "floor": 2 * bytes_per_element(precision),  # type: ignore[arg-type]
        "host_used": host["used"],
        "host_budget": host["budget"],
        "resident_slices": resident,
        "held_scales": held_scales,
        "largest_segment": largest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1MiB")
    parser.add_argument("--precision", default="8bit", choices=["fp32", "bf16", "8bit"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.budget, args.precision, args.steps)
    print(
        f"{result['params']:,} params, state_precision={args.precision}, "
        f"host_budget={args.budget}, {result['resident_slices']} resident slices, "
        f"segments of up to {result['largest_segment']:,} elements"
    )
    print(f"  read    {result['read']:.3f} B/param per steady step (format: {result['floor']:.3f})")
    print(f"  written {result['written']:.3f} B/param per steady step")
    print(f"  host tier after the steps: {result['host_used']:,} of {result['host_budget']:,} B")
    print(f"  8-bit scales held in host memory: {result['held_scales']:,} B (part of the budget)")


if __name__ == "__main__":
    main()
