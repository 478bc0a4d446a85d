"""Cache policies on a training-like cyclic schedule: bytes read per cycle and time per cycle.

A working set of ``--items`` tensors (``--item-size`` each) lives in a SwapStore; a TierCache
with a host budget of working set / ``--ratio`` walks the schedule ``--cycles`` times. Each
access pins the tensor at the host tier and updates it in place like an optimizer step
(``--pattern optimizer``: read-modify-write, every item once per cycle) or only reads it
(``--pattern fwd-bwd``: forward 0..n-1 then backward n-2..1, read only).

Reported per policy, over the steady-state cycles (all but the first):

- NVMe bytes read and written per cycle (the cache's own counters), and Belady's optimum for
  the reads (``tierswap.cache.simulate``, demand paging on the same schedule and budget);
- seconds per cycle against (a) the same loop with every tensor in RAM and (b) the I/O bound:
  bytes read / fio read bandwidth + bytes written / fio write bandwidth on the same folder.

Policies: ``lru``; ``lookahead`` (Belady eviction, schedule handed in); ``lru+prefetch`` (LRU
with an explicit ``prefetch`` of the next ``--window`` items at every step: reads everything,
but overlaps the reads with the work).

    PYTHONPATH=. python bench/cache_policy.py --dir /tmp --items 24 --item-size 4MiB --ratio 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierswap import LookaheadPolicy, SwapStore, TierCache
from tierswap.cache import simulate
from tierswap.cli import FioEngine, bench_folder, drop_page_cache, positive_int_arg, size_arg, which
from tierswap.config import format_size
from tierswap.errors import TierswapError

POLICIES = ("lru", "lookahead", "lru+prefetch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path(), help="folder on the disk to use")
    p.add_argument("--items", type=positive_int_arg, default=24, help="tensors (default 24)")
    p.add_argument("--item-size", type=size_arg, default="4MiB", help="bytes per tensor")
    p.add_argument("--ratio", type=float, default=3.0, help="working set / host budget")
    p.add_argument("--cycles", type=positive_int_arg, default=5, help="cycles (default 5)")
    p.add_argument("--window", type=positive_int_arg, default=2, help="lru+prefetch depth")
    p.add_argument("--pattern", choices=("optimizer", "fwd-bwd"), default="optimizer")
    return p.parse_args(argv)


def schedule_for(pattern: str, items: int) -> list[str]:
    keys = [f"layer{i}/state" for i in range(items)]
    if pattern == "fwd-bwd":
        return keys + keys[-2:0:-1]
    return keys


def make_step(pattern: str) -> Callable[[torch.Tensor], None]:
    if pattern == "optimizer":
        return lambda t: t.mul_(0.999).add_(0.001)  # touches every byte, like an Adam update
    return lambda t: t.sum().item()  # reads every byte


def fio_bandwidth(folder: Path, nbytes: int) -> tuple[float, float] | None:
    """(read, write) bytes/s of fio on ``folder`` (O_DIRECT, 8 MiB blocks), or None."""
    if which("fio") is None:
        return None
    engine = FioEngine(nbytes)
    write_bps = engine.write(folder)
    drop_page_cache(folder, "auto")
    return engine.read(folder), write_bps


def in_ram_seconds(schedule: list[str], numel: int, step: Callable, cycles: int) -> float:
    tensors = {key: torch.ones(numel) for key in dict.fromkeys(schedule)}
    times = []
    for _ in range(cycles):
        start = time.perf_counter()
        for key in schedule:
            step(tensors[key])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] or times)


def run_policy(name: str, folder: Path, args: argparse.Namespace, budget: int) -> dict:
    schedule = schedule_for(args.pattern, args.items)
    numel, step = args.item_size // 4, make_step(args.pattern)
    with SwapStore(folder / name.replace("+", "_"), mode="w", durable=False) as store:
        for key in dict.fromkeys(schedule):
            store.put(key, torch.ones(numel))
        policy = LookaheadPolicy(schedule=schedule) if name == "lookahead" else "lru"
        drop_page_cache(store.path, "auto")
        with TierCache(store, device_budget=0, host_budget=budget, policy=policy) as cache:
            rows = [_cycle(cache, schedule, step, name, args.window) for _ in range(args.cycles)]
        direct = store.direct
    steady = rows[1:] or rows
    return {
        "read": statistics.median(r[0] for r in steady),
        "written": statistics.median(r[1] for r in steady),
        "seconds": statistics.median(r[2] for r in steady),
        "stall": statistics.median(r[3] for r in steady),
        "direct": direct,
    }


def _cycle(
    cache: TierCache, schedule: list[str], step: Callable, name: str, window: int
) -> tuple[int, int, float, float]:
    before = cache.stats()
    start = time.perf_counter()
    for i, key in enumerate(schedule):
        if name == "lru+prefetch":
            ahead = [schedule[(i + j) % len(schedule)] for j in range(1, window + 1)]
            cache.prefetch(ahead, tier="host")
        with cache.pinned(key, tier="host", dirty=True) as t:
            step(t)
    seconds = time.perf_counter() - start
    after = cache.stats()
    return (
        after.nvme_bytes_read - before.nvme_bytes_read,
        after.nvme_bytes_written - before.nvme_bytes_written,
        seconds,
        after.stall_seconds - before.stall_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    schedule = schedule_for(args.pattern, args.items)
    working_set = args.items * args.item_size
    budget = int(working_set / args.ratio) // 4096 * 4096
    sizes = dict.fromkeys(schedule, args.item_size)
    belady = simulate(schedule, sizes, budget, cycles=args.cycles)
    belady_read = statistics.median(r.bytes for r in belady[1:] or belady)
    step = make_step(args.pattern)
    ram = in_ram_seconds(schedule, args.item_size // 4, step, args.cycles)
    print(f"pattern {args.pattern}: {len(schedule)} accesses/cycle over {args.items} tensors of ")
    print(f"  {format_size(args.item_size)}; working set {format_size(working_set)}, ")
    print(f"  host budget {format_size(budget)} (1/{args.ratio:g}); {args.cycles} cycles")
    try:
        with bench_folder(args.dir) as root:
            bandwidth = fio_bandwidth(root, min(working_set, 256 << 20))
            results = {name: run_policy(name, root, args, budget) for name in POLICIES}
    except TierswapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _report(results, belady_read, ram, bandwidth)
    return 0


def _report(results: dict, belady_read: float, ram: float, bandwidth: tuple | None) -> None:
    mib = 1 << 20
    if bandwidth:
        print(f"fio: read {bandwidth[0] / 1e9:.2f} GB/s, write {bandwidth[1] / 1e9:.2f} GB/s")
    print(f"in RAM: {ram * 1e3:.1f} ms/cycle; Belady reads {belady_read / mib:.1f} MiB/cycle")
    head = (
        "policy        read MiB  x Belady  write MiB  ms/cycle  stall ms  x RAM   x max(RAM, I/O)"
    )
    print(head)
    for name, r in results.items():
        bound = r["read"] / bandwidth[0] + r["written"] / bandwidth[1] if bandwidth else 0.0
        x_bound = f"{r['seconds'] / max(bound, ram):.2f}" if bandwidth else "n/a"
        print(
            f"{name:<13} {r['read'] / mib:8.1f}  {r['read'] / belady_read:8.2f}  "
            f"{r['written'] / mib:9.1f}  {r['seconds'] * 1e3:8.1f}  {r['stall'] * 1e3:8.1f}  "
            f"{r['seconds'] / ram:5.1f}   {x_bound} (bound {bound * 1e3:.1f} ms)"
        )
    direct = {r["direct"] for r in results.values()}
    print(f"store I/O: {'O_DIRECT' if direct == {True} else 'buffered'}")


if __name__ == "__main__":
    sys.exit(main())
