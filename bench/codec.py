"""Benchmark: the compact-state codec on the CPU, per element, against an fp32 copy.

    PYTHONPATH=. python bench/codec.py [--numel 16777216] [--rounds 5] [--step]
                                       [--threads N] [--cpu-time]

Times, on one slice of ``--numel`` fp32 moments (Adam-like magnitudes: ``randn * 1e-3`` for
the signed ``exp_avg``, its square for the unsigned ``exp_avg_sq``), each codec of
:mod:`tierswap.optim.formats` writing into preallocated arrays, as the optimizer's slice step
calls it: ``bf16`` encode (round to nearest even) and decode, ``8bit`` encode and decode
with the signed and the unsigned map, and a master's ``split`` into a bf16 parameter and a
remainder and their ``join``. The reference is ``out.copy_(x)`` between two fp32
arrays of the same length, the least a pass over the slice costs. Every figure is the best
of ``--rounds`` rounds, the codecs interleaved within each round so that machine load hits
them alike; the ratio to the copy is measured in the same run.

``--step`` also times a whole ``SwapOptimizer`` step per parameter (AdamW, four 2048 x 2048
weights, every slice resident in host memory, so no disk I/O) for each entry of ``STEPS``
(each ``state_precision`` on fp32 weights; bf16 weights with fp32 masters and with
remainders): what the formats add to torch's kernel. Results go to stdout as a table.
``TIERSWAP_NATIVE=0`` times the formats' torch ops instead of their C kernels.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tierswap as ts  # noqa: E402
from tierswap.optim import formats  # noqa: E402


def _codecs(numel: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    signed = torch.randn(numel, generator=gen) * 1e-3
    unsigned = signed.square()
    out = torch.empty(numel)
    half = torch.empty(numel, dtype=torch.bfloat16)
    codes = torch.empty(numel, dtype=torch.uint8)
    absmax = torch.empty(formats.num_blocks(numel))
    ucodes = torch.empty_like(codes)
    uabsmax = torch.empty_like(absmax)
    remainder = torch.empty(numel, dtype=torch.int16)
    formats.split(signed, half, remainder)
    formats.encode_bf16(signed, half)
    formats.encode_8bit(signed, codes, absmax, signed=True)
    formats.encode_8bit(unsigned, ucodes, uabsmax, signed=False)
    return {
        "fp32 copy": lambda: out.copy_(signed),
        "bf16 encode": lambda: formats.encode_bf16(signed, half),
        "bf16 decode": lambda: formats.decode_bf16(half, out),
        "8bit encode signed": lambda: formats.encode_8bit(signed, codes, absmax, signed=True),
        "8bit decode signed": lambda: formats.decode_8bit(codes, absmax, out, signed=True),
        "8bit encode unsigned": lambda: formats.encode_8bit(
            unsigned, ucodes, uabsmax, signed=False
        ),
        "8bit decode unsigned": lambda: formats.decode_8bit(ucodes, uabsmax, out, signed=False),
        "remainder split": lambda: formats.split(signed, half, remainder),
        "remainder join": lambda: formats.join(half, remainder, out),
    }


def _best(
    fns: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Best seconds of each function over ``rounds`` interleaved rounds (after a warm-up)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


#: Resident steps timed by --step: name -> (parameter dtype, SwapOptimizer options).
STEPS: dict[str, tuple[torch.dtype, dict[str, str]]] = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.float32, {"state_precision": "bf16"}),
    "8bit": (torch.float32, {"state_precision": "8bit"}),
    "bf16 params, fp32 master": (torch.bfloat16, {}),
    "bf16 params, remainder": (torch.bfloat16, {"master": "remainder"}),
}


def _step_fns(
    names: list[str], folder: Path
) -> tuple[dict[str, Callable[[], object]], int, list[object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    fns: dict[str, Callable[[], object]] = {}
    opts: list[object] = []
    for i, name in enumerate(names):
        dtype, options = STEPS[name]
        copy_ = copy.deepcopy(model).to(dtype)
        opt = ts.SwapOptimizer(
            copy_.parameters(), torch.optim.AdamW, lr=1e-4, swap_dir=folder / f"step{i}",
            commit_every=0, **options,
        )  # fmt: skip
        for p in copy_.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()  # creates the state

        def step(opt: ts.SwapOptimizer = opt) -> None:
            opt.step()
            opt.synchronize()

        fns[f"step {name}"] = step
        opts.append(opt)
    return fns, sum(p.numel() for p in model.parameters()), opts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=16 << 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step", action="store_true", help="also time a resident AdamW step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time (all threads) instead of the wall clock: "
        "steadier on a machine shared with other work",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, numel {args.numel}, "
        f"{'CPU time' if args.cpu_time else 'wall clock'}, best of {args.rounds}"
    )
    best = _best(_codecs(args.numel), args.rounds, clock)
    copy_ns = best["fp32 copy"] / args.numel * 1e9
    print(f"{'codec':24s} {'ns/element':>10s} {'x fp32 copy':>12s}")
    for name, seconds in best.items():
        ns = seconds / args.numel * 1e9
        print(f"{name:24s} {ns:10.3f} {ns / copy_ns:12.2f}")
    if args.step:
        with tempfile.TemporaryDirectory(prefix="tierswap-codec-") as folder:
            fns, numel, opts = _step_fns(list(STEPS), Path(folder))
            steps = _best(fns, args.rounds, clock)
            for opt in opts:
                opt.close()  # type: ignore[attr-defined]
        fp32 = steps["step fp32"]
        print(f"{'AdamW step, resident':32s} {'ns/param':>10s} {'x fp32 step':>12s}")
        for name, seconds in steps.items():
            print(f"{name:32s} {seconds / numel * 1e9:10.3f} {seconds / fp32:12.2f}")


if __name__ == "__main__":
    main()
