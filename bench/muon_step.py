"""Benchmark: an offloaded torch.optim.Muon step against the same step in memory and the I/O
bound, and where its time goes.

    python bench/muon_step.py --matrices 32 --dim 512 [--dir /nvme/bench] [--json out.json]

One process, steps interleaved (memory, offloaded, memory, ...) so that machine load hits both
alike; both end bit-identical, which is checked. The offloaded optimizer keeps a quarter of the
state's working set as host budget, so most whole-matrix slices stream from disk. The I/O bound
is the bytes the offloaded step read and wrote at the store's own sequential throughput,
measured on the same folder in the same run. Newton-Schulz is compute: the in-memory step is
its cost, the offloaded step's stall (seconds waiting for reads) is what the disk adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tierswap as ts  # noqa: E402


def _matrices(count: int, dim: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(dim, dim, generator=gen) / dim**0.5)
        p.grad = torch.randn(dim, dim, generator=gen)
        params.append(p)
    return params


def _timed(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _store_throughput(folder: Path, nbytes: int) -> tuple[float, float]:
    """Sequential write (put + commit) and read throughput of a SwapStore, bytes/s."""
    data = torch.randn(nbytes // 4)
    with ts.SwapStore(folder / "throughput") as store:
        start = time.perf_counter()
        store.put("t", data)
        store.commit()
        write = nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        store.get("t")
        read = nbytes / (time.perf_counter() - start)
    return write, read


def run(args: argparse.Namespace, folder: Path) -> dict:
    plain_params, swap_params = (
        _matrices(args.matrices, args.dim),
        _matrices(args.matrices, args.dim),
    )
    plain = torch.optim.Muon(plain_params, lr=0.02)
    state = args.matrices * args.dim * args.dim * 4  # momentum_buffer, fp32
    probe = ts.SwapOptimizer(swap_params[:1], torch.optim.Muon, lr=0.02, swap_dir=folder / "probe")
    whole = probe.slices[0].working_set  # one matrix, its state and temporaries
    probe.close()
    budget = max(whole * args.matrices // args.fraction, whole)
    swap = ts.SwapOptimizer(
        swap_params, torch.optim.Muon, lr=0.02, swap_dir=folder / "swap", host_budget=budget,
        commit_every=0,
    )  # fmt: skip
    plain.step()  # the first steps create the state
    swap.step()
    before = swap.tier_stats()
    plain_times, swap_times = [], []
    for _ in range(args.steps):
        plain_times.append(_timed(plain))
        swap_times.append(_timed(swap))
    after = swap.tier_stats()
    same = all(torch.equal(a, b) for a, b in zip(plain_params, swap_params, strict=True))
    swap.close()
    read = (after["nvme"]["bytes_read"] - before["nvme"]["bytes_read"]) / args.steps
    written = (after["nvme"]["bytes_written"] - before["nvme"]["bytes_written"]) / args.steps
    write_bw, read_bw = _store_throughput(folder, args.throughput_bytes)
    memory_s, swap_s = statistics.median(plain_times), statistics.median(swap_times)
    bound = read / read_bw + written / write_bw
    stall = (after["stall_seconds"] - before["stall_seconds"]) / args.steps
    return {
        "params": args.matrices * args.dim * args.dim,
        "state_bytes": state,
        "host_budget": budget,
        "slices": len(swap.slices),
        "memory_step_s": memory_s,
        "swap_step_s": swap_s,
        "io_bound_s": bound,
        "swap_vs_max": swap_s / max(memory_s, bound),
        "swap_vs_memory": swap_s / memory_s,
        "stall_s": stall,
        "bytes_read_per_step": read,
        "bytes_written_per_step": written,
        "store_write_Bps": write_bw,
        "store_read_Bps": read_bw,
        "bit_identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", type=int, default=32)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fraction", type=int, default=4, help="host budget = working set / this")
    parser.add_argument("--throughput-bytes", type=int, default=256 << 20)
    parser.add_argument("--dir", default=None, help="folder on the disk to test (default: tmp)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        report = run(args, Path(tmp))
    for key, value in report.items():
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
