"""Benchmark: state larger than RAM, and one parameter larger than the host budget.

    PYTHONPATH=. python bench/scale.py --dir /nvme/bench                       # both cases
    PYTHONPATH=. python bench/scale.py --dir /nvme/bench --cases single --single 100M  # smoke

Two cases, each in its own process (so its peak RSS is its own):
  model   bf16 parameters of --params elements in all (default 2B: 4 GiB of weights and 4 GiB of
          gradients in RAM; 24 GiB of fp32 masters and AdamW state on disk), in tensors of
          --tensor elements, host budget --host-budget (default 2 GiB)
  single  one fp32 parameter of --single elements (default 500M: 4 GiB of AdamW state) under
          a host budget of --single-budget (default 256 MiB)
Gradients are set directly (random, once): the step is what is measured. Per step it reports
the seconds, the bytes read and written (the store's counters), the I/O bound (those
bytes at fio's sequential O_DIRECT bandwidth on the same folder, measured before the case) and
peak RSS against runtime + params + grads + host budget + 10%. Targets (issue 9): every step
after the first <= 1.15 x the I/O bound; bytes read per step = the state's size less the
resident slices (read once, kept in memory), bytes written = the state's size (plus the fp32
parameters at a commit: the single case commits every step; the model's masters are state);
peak RSS within the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _peak import peak_rss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _child import add_child_arguments, spawn  # noqa: E402
from _fio import required_fio_bandwidth  # noqa: E402

from tierswap.cli import bench_folder  # noqa: E402
from tierswap.config import format_size, parse_size  # noqa: E402

TARGET = 1.15


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """One case, in this process: build the params, step, report."""
    import torch

    import tierswap as ts

    warm = torch.nn.Parameter(torch.zeros(8))
    warm.grad = torch.zeros(8)
    torch.optim.AdamW([warm]).step()  # load torch's optimizer machinery before the baseline
    runtime = _rss()
    gen = torch.Generator().manual_seed(0)
    if args.case == "model":
        total, size, dtype, budget = args.params, args.tensor, torch.bfloat16, args.host_budget
        sizes = [size] * (total // size) + ([total % size] if total % size else [])
    else:
        sizes, dtype, budget = [args.single], torch.float32, args.single_budget
    params = []
    for numel in sizes:
        param = torch.nn.Parameter(torch.empty(numel, dtype=dtype).normal_(generator=gen))
        param.grad = torch.empty_like(param).normal_(generator=gen)
        params.append(param)
    held = sum(2 * p.numel() * p.element_size() for p in params)
    opt = ts.SwapOptimizer(params, torch.optim.AdamW, lr=1e-4, swap_dir=args.swap_dir,
                           host_budget=budget)  # fmt: skip
    steps = []
    with opt:
        for _ in range(args.steps):
            before = opt.tier_stats()["nvme"]
            start = time.perf_counter()
            opt.step()
            opt.synchronize()  # count this step's writes in this step
            seconds = time.perf_counter() - start
            after = opt.tier_stats()["nvme"]
            steps.append({
                "seconds": seconds,
                "read": after["bytes_read"] - before["bytes_read"],
                "written": after["bytes_written"] - before["bytes_written"],
            })  # fmt: skip
        slices = len(opt.slices)
        resident = sum(  # bytes the resident slices keep in memory: read once, never again
            seg.numel * (sum(seg.slot.state_itemsizes) + 4 * seg.slot.has_master)
            for piece in opt.slices
            if piece.index in opt.placement
            for seg in piece.segments
        )
    numel = sum(sizes)
    state = numel * (12 if dtype == torch.bfloat16 else 8)
    peak = peak_rss()
    return {"case": args.case, "params": numel, "tensors": len(sizes), "dtype": str(dtype),
            "host_budget": budget, "state_bytes": state, "params_bytes": numel * 4,
            "slices": slices, "resident_bytes": resident, "steps": steps,
            "runtime_rss": runtime, "peak_rss": peak, "params_and_grads": held}  # fmt: skip


def _spawn(args: argparse.Namespace, case: str, folder: Path) -> dict[str, Any]:
    return spawn(__file__, case, folder, [
        "--params", str(args.params), "--tensor", str(args.tensor),
        "--host-budget", str(args.host_budget), "--single", str(args.single),
        "--single-budget", str(args.single_budget), "--steps", str(args.steps),
    ])  # fmt: skip


def report(result: dict[str, Any], fio: dict[str, float]) -> dict[str, Any]:
    """Per-step ratios to the I/O bound, and the memory bound."""
    rows = []
    for index, step in enumerate(result["steps"]):
        bound = step["read"] / fio["read"] + step["written"] / fio["write"]
        rows.append({**step, "io_bound_s": bound, "x_bound": step["seconds"] / bound,
                     "first": index == 0})  # fmt: skip
    limit = 1.1 * (result["params_and_grads"] + result["host_budget"])
    steady = [r for r in rows if not r["first"]]
    return {
        **result, "fio": fio, "rows": rows, "rss_limit": limit,
        "rss_above_runtime": result["peak_rss"] - result["runtime_rss"],
        "steady_max_x_bound": max((r["x_bound"] for r in steady), default=None),
        "read_equals_state": all(
            r["read"] == result["state_bytes"] - result["resident_bytes"] for r in steady
        ),
    }  # fmt: skip


def print_report(rep: dict[str, Any]) -> None:
    print(f"\n== {rep['case']}: {rep['params'] / 1e9:.2f}B {rep['dtype']} params in "
          f"{rep['tensors']} tensors, host budget {format_size(rep['host_budget'])}, "
          f"{rep['slices']} slices, state {format_size(rep['state_bytes'])} on disk")  # fmt: skip
    print(f"fio: read {rep['fio']['read'] / 1e9:.2f} GB/s, write {rep['fio']['write'] / 1e9:.2f}")
    print("step | s      | read      | written   | I/O bound s | x bound")
    for i, r in enumerate(rep["rows"], 1):
        print(f"{i:4} | {r['seconds']:6.2f} | {format_size(r['read']):>9} | "
              f"{format_size(r['written']):>9} | {r['io_bound_s']:11.2f} | {r['x_bound']:.2f}"
              + ("  (creates the state)" if r["first"] else ""))  # fmt: skip
    ok = rep["steady_max_x_bound"] is not None and rep["steady_max_x_bound"] <= TARGET
    print(
        f"steady steps <= {TARGET} x I/O bound: {'PASS' if ok else 'FAIL'} "
        f"(max {rep['steady_max_x_bound']:.2f})"
    )
    print(f"bytes read per step = state - resident slices ({format_size(rep['resident_bytes'])})"
          f": {'PASS' if rep['read_equals_state'] else 'FAIL'}")  # fmt: skip
    above, limit = rep["rss_above_runtime"], rep["rss_limit"]
    print(
        f"peak RSS above runtime {format_size(above)} <= params + grads + budget + 10% "
        f"{format_size(int(limit))}: {'PASS' if above <= limit else 'FAIL'}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp", help="parent folder of the swap folders")
    parser.add_argument("--cases", default="model,single")
    parser.add_argument("--params", type=parse_size, default=parse_size("2G"))
    parser.add_argument("--tensor", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--host-budget", type=parse_size, default=parse_size("2GiB"))
    parser.add_argument("--single", type=parse_size, default=parse_size("500M"))
    parser.add_argument("--single-budget", type=parse_size, default=parse_size("256MiB"))
    parser.add_argument("--steps", type=int, default=3)
    add_child_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        args.case = args.child
        print(json.dumps(run_case(args)))
        return
    reports = []
    with bench_folder(Path(args.dir)) as folder:
        for case in args.cases.split(","):
            fio = required_fio_bandwidth(folder, 1 << 30)
            rep = report(_spawn(args, case, folder), fio)
            print_report(rep)
            reports.append(rep)
    out = Path(args.json) if args.json else ROOT / "bench" / "out" / "scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
