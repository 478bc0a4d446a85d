"""What the StreamedParameter guard costs: forward + backward with streamed parameters, the
guard on against a no-op guard, interleaved rounds, the ratio printed per round.

24 x Linear(512, 512) with GELU, batch 32, AdamW, every parameter kept in a 64 MiB device
budget: nothing is read between uses, so what differs is the guard's Python on each operation
that touches a parameter (small layers: the worst case for a per-operation cost).

    PYTHONPATH=. python bench/stream_guard.py [--dir FOLDER] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import tierswap as ts
import tierswap.optim.stream._stream as stream_module

_GUARD = stream_module.guard


def fwd_bwd_seconds(guarded: bool, folder: str | None) -> float:
    """The median forward + backward time of iterations 3-8 of one run."""
    stream_module.guard = _GUARD if guarded else (lambda *args: None)
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(512, 512) for _ in range(24)]
        model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())])
        x = torch.randn(32, 512)
        with tempfile.TemporaryDirectory(dir=folder) as swap_dir:
            opt = ts.SwapOptimizer(
                model, torch.optim.AdamW, lr=1e-3, swap_dir=swap_dir, host_budget=None,
                device_budget="64MiB", offload_parameters=True,
            )  # fmt: skip
            times = []
            for _ in range(8):
                started = time.perf_counter()
                model(x).square().mean().backward()
                times.append(time.perf_counter() - started)
                opt.step()
                opt.zero_grad()
            opt.close()
        return statistics.median(times[2:])
    finally:
        stream_module.guard = _GUARD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="folder for the swap folders")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for r in range(args.rounds):
        off, on = fwd_bwd_seconds(False, args.dir), fwd_bwd_seconds(True, args.dir)
        print(f"round {r}: forward+backward without the guard {off * 1e3:.1f} ms, "
              f"with it {on * 1e3:.1f} ms: {on / off:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
