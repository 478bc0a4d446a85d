"""The standalone swap API: store tensors by key, commit, read them back; then the tier cache
over the store (budgets, prefetch, pinned, asyncio).

Run: ``python examples/swap_api.py --swap-dir swap --size 512MiB``
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

import tierswap as ts
from tierswap.config import format_size, parse_size


def store_demo(swap_dir: Path, total_bytes: int, tensors: int = 8) -> None:
    """Put ``tensors`` fp32 tensors of ``total_bytes`` in all, commit, read back, report GB/s."""
    numel = total_bytes // tensors // 4
    values = {f"layer{i}/exp_avg": torch.randn(numel) for i in range(tensors)}
    with ts.SwapStore(swap_dir / "store", mode="w") as store:
        start = time.perf_counter()
        futures = [store.put_async(key, value) for key, value in values.items()]
        for future in futures:
            future.result()
        store.commit({"step": 0})
        write_s = time.perf_counter() - start

        outs = {key: torch.empty_like(value) for key, value in values.items()}
        for out in outs.values():
            out.zero_()  # fault the pages in before timing, as a training loop's buffers are
        start = time.perf_counter()
        reads = [store.get_async(key, out=outs[key]) for key in values]
        for future in reads:
            future.result()
        read_s = time.perf_counter() - start

        assert all(torch.equal(outs[k], v) for k, v in values.items()), "read-back mismatch"
        nbytes = sum(v.numel() * 4 for v in values.values())
        mode = "O_DIRECT" if store.direct else "buffered"
        print(f"store: {len(values)} tensors, {format_size(nbytes)} at {store.path} ({mode})")
        write_gbps, read_gbps = nbytes / write_s / 1e9, nbytes / read_s / 1e9
        print(f"  put+commit {write_gbps:6.2f} GB/s   get {read_gbps:6.2f} GB/s")
        print(f"  generation {store.generation}, on disk {format_size(store.disk_usage())}")


def cache_demo(swap_dir: Path, total_bytes: int, tensors: int = 8) -> None:
    """Walk ``tensors`` tensors 3 times through a host budget of a third of them."""
    numel = total_bytes // tensors // 4
    keys = [f"layer{i}/exp_avg" for i in range(tensors)]
    with ts.SwapStore(swap_dir / "cache", mode="w", durable=False) as store:
        for key in keys:
            store.put(key, torch.zeros(numel))
        budget = total_bytes // 3
        policy = ts.LookaheadPolicy(schedule=keys)  # the order one step touches the state
        with ts.TierCache(store, device_budget=0, host_budget=budget, policy=policy) as cache:
            start = time.perf_counter()
            for _step in range(3):
                for key in keys:
                    with cache.pinned(key, tier="host", dirty=True) as t:  # resident, in place
                        t.add_(1)
            elapsed = time.perf_counter() - start
            first = asyncio.run(cache.aget(keys[0], tier="host"))  # asyncio variant of get
            assert bool((first == 3).all()), "cache lost an update"
            stats = cache.stats()
        store.commit()  # close() flushed every dirty item; commit makes them durable
    print(f"cache: {tensors} tensors, host budget {format_size(budget)}, policy lookahead")
    print(f"  3 cycles in {elapsed:.2f} s, stall {stats.stall_seconds:.2f} s")
    print(
        f"  NVMe read {format_size(stats.nvme_bytes_read)}, written "
        f"{format_size(stats.nvme_bytes_written)}, host hits {stats.host.hits}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--swap-dir", type=Path, default=Path("swap"))
    parser.add_argument("--size", default="512MiB", help="bytes of tensors to store")
    args = parser.parse_args()
    store_demo(args.swap_dir, parse_size(args.size))
    cache_demo(args.swap_dir, parse_size(args.size) // 4)


if __name__ == "__main__":
    main()
