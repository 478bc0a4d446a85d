"""Benchmark: torch's AdamW kernel on one slice, whole or cut into blocks, on the CPU.

    PYTHONPATH=. python bench/step_blocks.py [--numel 16777216] [--rounds 3]
                                             [--blocks 131072,65536,32768,1048576]

Why ``tierswap.optim.step._slice_work.STEP_BLOCK`` exists: torch's for-loop kernels (the default on
the CPU) make a temporary of the tensor's size per operation and pass over memory once per
operation, so on blocks that fit a core's cache they run faster, until Python's per-tensor
overhead takes over. For each kernel (for-loop, foreach, fused) this times one ``step()`` over
``--numel`` fp32 parameters with existing state (as a streamed slice steps), given as one
tensor and as blocks of each size, interleaved within each round; the best of ``--rounds``.
Runs under the step's mmap threshold (1 MiB, as ``SwapOptimizer.step`` does). Prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierswap.optim.step import step_allocations  # noqa: E402

KERNELS = {"for-loop": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _step_seconds(tensors: dict[str, torch.Tensor], block: int, kernel: dict[str, bool]) -> float:
    """One AdamW step over the slice given as blocks of ``block`` elements."""
    numel = tensors["param"].numel()
    params, state = [], {}
    for lo in range(0, numel, block):
        piece = tensors["param"][lo : lo + block]
        piece.grad = tensors["grad"][lo : lo + block]
        params.append(piece)
        state[piece] = {
            "step": torch.tensor(5.0),
            "exp_avg": tensors["exp_avg"][lo : lo + block],
            "exp_avg_sq": tensors["exp_avg_sq"][lo : lo + block],
        }
    opt = torch.optim.AdamW(params, lr=1e-4, **kernel)
    opt.state = defaultdict(dict, state)
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", default="131072,65536,32768,1048576")
    args = p.parse_args()
    with step_allocations():  # the threshold a step runs under
        _run(args)


def _run(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "param": torch.randn(args.numel, generator=gen),
        "grad": torch.randn(args.numel, generator=gen) * 1e-3,
        "exp_avg": torch.randn(args.numel, generator=gen) * 1e-3,
        "exp_avg_sq": torch.rand(args.numel, generator=gen) * 1e-6,
    }
    sizes = [args.numel] + [int(b) for b in args.blocks.split(",")]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for name, kernel in KERNELS.items():
            for size in sizes:
                seconds = _step_seconds(tensors, size, kernel)
                best[name, size] = min(best.get((name, size), seconds), seconds)
    threads = torch.get_num_threads()
    print(f"AdamW step, {args.numel} fp32 elements, best of {args.rounds}, {threads} threads")
    print(f"{'kernel':10} {'block':>10} {'ms':>8} {'x whole':>8}")
    for name in KERNELS:
        whole = best[name, args.numel]
        for size in sizes:
            label = "whole" if size == args.numel else str(size)
            ms = best[name, size] * 1e3
            print(f"{name:10} {label:>10} {ms:8.1f} {whole / best[name, size]:7.2f}x")


if __name__ == "__main__":
    main()
