"""How long streamed parameters take to refill on the CPU: memory reused against memory new
from torch's allocator, in a streamed GPT-2.

    PYTHONPATH=. python bench/param_refill.py [--layers 10] [--device-budgets 0,1GiB]
                                              [--rounds 2] [--dir FOLDER]

The model is bench/big_model.py's GPT-2 (width 2560, built on the meta device, batch 4 x 64,
clipping at 1.0, AdamW), given to ``SwapOptimizer(model, ..., offload_parameters=True,
host_budget=2GiB, durable=False)`` at each ``--device-budgets``. Two modes, each run in a
process of its own, interleaved per round:

  allocator  every refill takes new memory from torch's allocator (``POOLED_FROM`` raised past
             every parameter: the stream before 2026-12-06)
  reused     the default: a large parameter's memory, once freed, stays idle within what
             ``device_budget`` leaves beside the parameters holding values and a share of
             ``host_budget`` (at most a quarter) set aside for it, for the next parameter of
             its size

Each iteration prints forward + backward seconds, and the seconds, bytes and GB/s of the
refills' copies (``PassThrough.to_device``, timed around each call; the page faults of new
memory land in them). Iteration 1 records the order of uses; the summary takes 2 on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _child import add_child_arguments, spawn

from tierswap.config import parse_size


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One run, in this process: each iteration's times."""
    import torch
    from big_model import CLIP, _model, _tokens

    import tierswap as ts
    from tierswap.engine import transfer
    from tierswap.optim.stream import _storage

    if args.child == "allocator":
        _storage.POOLED_FROM = 1 << 62
    spent = {"seconds": 0.0, "bytes": 0}
    to_device = transfer.PassThrough.to_device

    def timed(self: Any, host: torch.Tensor, device: Any = None, **kwargs: Any) -> Any:
        started = time.perf_counter()
        copy = to_device(self, host, device, **kwargs)
        spent["seconds"] += time.perf_counter() - started
        spent["bytes"] += host.numel() * host.element_size()
        return copy

    transfer.PassThrough.to_device = timed  # type: ignore[method-assign]
    model = _model(args.layers, 2560, meta=True)
    tokens = _tokens(model.config.vocab_size)
    torch.manual_seed(0)
    opt = ts.SwapOptimizer(
        model, torch.optim.AdamW, lr=3e-5, weight_decay=0.0, swap_dir=args.swap_dir,
        host_budget=2 << 30, device_budget=args.device_budget, offload_parameters=True,
        durable=False, param_init_fn=model._init_weights,
    )  # fmt: skip
    rows = []
    for _ in range(args.iterations):
        spent.update(seconds=0.0, bytes=0)
        started = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        rows.append({"fwd_bwd": time.perf_counter() - started, **spent})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    opt.close()
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--device-budgets", default="0,1GiB")
    parser.add_argument("--device-budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None)
    add_child_arguments(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for budget in args.device_budgets.split(","):
            for mode in ("allocator", "reused"):
                size = str(parse_size(budget))
                forwarded = ["--layers", str(args.layers), "--iterations", str(args.iterations)]
                with tempfile.TemporaryDirectory(dir=args.dir) as folder:
                    run = spawn(__file__, mode, Path(folder), [*forwarded, "--device-budget", size])
                rows = run["rows"]
                for index, row in enumerate(rows, 1):
                    rate = row["bytes"] / max(row["seconds"], 1e-9) / 1e9
                    print(
                        f"round {round_ + 1} device_budget {budget} {mode} iteration {index}: "
                        f"forward + backward {row['fwd_bwd']:.1f} s, refills "
                        f"{row['seconds']:.2f} s for {row['bytes'] / 1e9:.1f} GB ({rate:.2f} GB/s)",
                        flush=True,
                    )
                results.setdefault((budget, mode), []).extend(rows[1:])
    print("\nmedians of iterations 2 on:")
    for (budget, mode), rows in results.items():
        fwd_bwd = statistics.median(r["fwd_bwd"] for r in rows)
        refill = statistics.median(r["seconds"] for r in rows)
        rate = statistics.median(r["bytes"] / max(r["seconds"], 1e-9) / 1e9 for r in rows)
        print(
            f"device_budget {budget:>6} {mode:9}: forward + backward {fwd_bwd:.1f} s, "
            f"refills {refill:.2f} s ({rate:.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
