"""Benchmark: an offloaded AdamW step against fused AdamW in memory and against the I/O bound.

    python bench/optimizer_step.py --params 100M --dir /nvme/bench [--json out.json]

Two runs, each in its own process so peak RSS is its own:
  ram  : torch.optim.AdamW(fused=True) in memory (baseline (a)) and SwapOptimizer with the whole
         state in RAM, steps interleaved so machine load hits both alike -> throughput vs (a)
  swap : SwapOptimizer, host budget = state / 8, state on disk           -> step vs max(a, b)
(b) is the I/O bound: state bytes read plus written per step divided by fio's sequential
O_DIRECT bandwidth on the same folder. Targets (issue 4): swap <= 1.15 x max(a, b); peak RSS of
swap <= params + grads + budget + 10%; ram throughput >= 0.95 x (a).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _peak import peak_rss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierswap.config import format_size, parse_size  # noqa: E402


def _params(n_params: int, n_tensors: int) -> list[torch.nn.Parameter]:
    """``n_tensors`` fp32 parameters (like a model's layers) with random gradients."""
    gen = torch.Generator().manual_seed(0)
    size = n_params // n_tensors
    params = []
    for _ in range(n_tensors):
        p = torch.nn.Parameter(torch.randn(size, generator=gen))
        p.grad = torch.randn(size, generator=gen)
        params.append(p)
    return params


def _time_steps(opt: torch.optim.Optimizer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def _run_ram(args: argparse.Namespace) -> dict:
    """Fused AdamW in memory and SwapOptimizer with all state in RAM, steps interleaved.

    Interleaving keeps the ratio honest on a machine whose load changes over time; both end
    with bit-identical parameters, which is checked.
    """
    import tierswap as ts

    plain_params, swap_params = (
        _params(args.params, args.tensors),
        _params(args.params, args.tensors),
    )
    plain = torch.optim.AdamW(plain_params, lr=1e-4, fused=True)
    swap = ts.SwapOptimizer(
        swap_params, torch.optim.AdamW, lr=1e-4, fused=True, swap_dir=args.dir,
        host_budget=None, durable=False, commit_every=0,
    )  # fmt: skip
    plain.step()  # the first steps allocate the state
    swap.step()
    plain_times, swap_times = [], []
    for _ in range(args.steps):
        plain_times += _time_steps(plain, 1)
        swap_times += _time_steps(swap, 1)
    same = all(torch.equal(a, b) for a, b in zip(plain_params, swap_params, strict=True))
    swap.close()
    return {
        "memory_median_s": statistics.median(plain_times),
        "median_s": statistics.median(swap_times),
        "memory_times": plain_times,
        "times": swap_times,
        "bit_identical": same,
    }


def _run_swap(args: argparse.Namespace) -> dict:
    import tierswap as ts

    params = _params(args.params, args.tensors)
    budget = max(8 * args.params // args.fraction, 1)
    opt = ts.SwapOptimizer(
        params, torch.optim.AdamW, lr=1e-4, fused=True, swap_dir=args.dir,
        host_budget=budget, durable=False, commit_every=0,
    )  # fmt: skip
    opt.step()  # creates the state (and, under a small budget, writes it out)
    before = opt.tier_stats()["nvme"]
    times = _time_steps(opt, args.steps)
    stats = opt.tier_stats()
    moved = sum(stats["nvme"][k] - before[k] for k in ("bytes_read", "bytes_written"))
    opt.close()
    return {
        "budget": budget,
        "bytes_per_step": moved / args.steps,
        "stall_seconds": stats.get("stall_seconds"),
        "median_s": statistics.median(times),
        "times": times,
    }


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_child(args: argparse.Namespace) -> dict:
    """One mode, in this process; prints a JSON line with its timings and peak RSS."""
    import tierswap  # noqa: F401  (the runtime baseline includes the library)

    warm = torch.nn.Parameter(torch.zeros(8))
    warm.grad = torch.zeros(8)
    torch.optim.AdamW([warm]).step()  # torch loads its optimizer machinery (~80 MB) on first use
    runtime = _rss_now() if os.path.exists("/proc/self/statm") else 0
    result = {"mode": args.mode, **(_run_ram(args) if args.mode == "ram" else _run_swap(args))}
    result["runtime_rss"] = runtime
    result["peak_rss"] = peak_rss()
    print(json.dumps(result), flush=True)
    return result


def _fio_bandwidth(folder: Path, rw: str, size: str) -> float | None:
    """Sequential O_DIRECT bandwidth (bytes/s) from fio, or None when fio is missing."""
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio", f"--name=bench-{rw}", f"--directory={folder}", f"--rw={rw}", "--bs=8M",
        f"--size={size}", "--direct=1", "--ioengine=psync", "--numjobs=4", "--group_reporting",
        "--output-format=json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"]


def _spawn(args: argparse.Namespace, mode: str, folder: Path) -> dict:
    cmd = [
        sys.executable, __file__, "--child", "--mode", mode, "--params", str(args.params),
        "--tensors", str(args.tensors), "--steps", str(args.steps), "--fraction",
        str(args.fraction), "--dir", str(folder / f"swap-{mode}"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _report(args: argparse.Namespace, runs: dict, bw: dict) -> dict:
    a = runs["ram"]["memory_median_s"]
    swap = runs["swap"]
    b = None
    if bw["read"] and bw["write"]:
        b = swap["bytes_per_step"] / 2 / bw["read"] + swap["bytes_per_step"] / 2 / bw["write"]
    bound = max(a, b or 0.0)
    params_grads = 8 * args.params
    report = {
        "params": args.params,
        "state_bytes": 8 * args.params,
        "fio_bandwidth": bw,
        "memory_fused_adamw_s": a,
        "ram_s": runs["ram"]["median_s"],
        "ram_throughput_vs_fused": a / runs["ram"]["median_s"],
        "ram_bit_identical": runs["ram"]["bit_identical"],
        "swap_s": swap["median_s"],
        "io_bound_s": b,
        "swap_vs_max_a_b": swap["median_s"] / bound,
        "swap_budget": swap["budget"],
        "swap_bytes_per_step": swap["bytes_per_step"],
        "swap_peak_rss": swap["peak_rss"],
        "swap_runtime_rss": swap["runtime_rss"],
        "rss_limit": 1.1 * (params_grads + swap["budget"]),
        "runs": runs,
    }
    print(f"params {args.params / 1e6:.0f}M, state {format_size(8 * args.params)}, "
          f"host budget {format_size(swap['budget'])}")  # fmt: skip
    print(f"(a) fused AdamW in memory      {a:.3f} s/step ({args.params / a / 1e9:.2f} G params/s)")
    ram_ratio = report["ram_throughput_vs_fused"]
    print(f"    state in RAM (tierswap)    {report['ram_s']:.3f} s/step "
          f"-> {ram_ratio:.2f}x fused throughput (target >= 0.95), "
          f"bit-identical: {report['ram_bit_identical']}")  # fmt: skip
    if b is not None:
        print(f"(b) I/O bound                  {b:.3f} s/step "
              f"({format_size(swap['bytes_per_step'])} moved; fio read "
              f"{format_size(bw['read'])}/s, write {format_size(bw['write'])}/s)")  # fmt: skip
    print(f"    state on disk (tierswap)   {swap['median_s']:.3f} s/step "
          f"-> {report['swap_vs_max_a_b']:.2f}x max(a, b) (target <= 1.15)")  # fmt: skip
    above = swap["peak_rss"] - swap["runtime_rss"]
    print(f"    peak RSS {format_size(swap['peak_rss'])}; above the Python + torch runtime "
          f"({format_size(swap['runtime_rss'])}): {format_size(above)} vs params + grads + "
          f"budget + 10% = {format_size(report['rss_limit'])}")  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_size, default="100M", help="e.g. 100M, 1G")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fraction", type=int, default=8, help="host budget = state / this")
    parser.add_argument("--dir", default=None, help="folder on the disk to test (default: tmp)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--mode", choices=["ram", "swap"], help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    folder = Path(args.dir or tempfile.mkdtemp(prefix="tierswap-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fio_size = f"{max(min(8 * args.params, 2 << 30) >> 20, 64)}M"  # MiB for fio
        bw = {rw: _fio_bandwidth(folder, rw, fio_size) for rw in ("write", "read")}
        runs = {mode: _spawn(args, mode, folder) for mode in ("ram", "swap")}
        report = _report(args, runs, bw)
    finally:
        for leftover in folder.glob("bench-*"):
            leftover.unlink()
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
