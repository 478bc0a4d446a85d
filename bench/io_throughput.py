"""Store throughput against the operating system's ceiling on the same folder.

Times ``SwapStore.put`` + ``commit`` (durable: fsynced) and ``get`` of one ``--size`` tensor,
``fio`` (O_DIRECT, libaio, 8 MiB blocks, iodepth 32, end_fsync) and ``dd`` (``oflag=direct
conv=fsync`` / ``iflag=direct``), ``--repeat`` times, interleaved; the page cache is dropped
before each read. Prints medians (min-max), each ratio to fio, and whether the store reaches the
target of 0.95x fio both ways. The store runs with ``IOConfig.default()`` (``$TIERSWAP_CONFIG``,
e.g. a file from ``tierswap bench --tune``) unless --block-size / --threads are given.

    python bench/io_throughput.py --dir /nvme/tmp --size 1GiB --repeat 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from tierswap.cli import (
    BenchReport,
    DdEngine,
    Engine,
    FioEngine,
    Result,
    Setting,
    StoreEngine,
    bench_folder,
    check_free_space,
    positive_int_arg,
    print_table,
    random_source,
    run_trial,
    size_arg,
    which,
    write_json,
)
from tierswap.config import IOConfig
from tierswap.errors import BenchmarkError, TierswapError
from tierswap.io import aligned_empty

TARGET = 0.95


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path(), help="folder on the disk to measure")
    p.add_argument("--size", type=size_arg, default="1GiB", help="tensor bytes (default 1GiB)")
    p.add_argument("--repeat", type=positive_int_arg, default=3, help="trials (default 3)")
    p.add_argument("--block-size", type=size_arg, help="store request size (default: config)")
    p.add_argument("--threads", type=positive_int_arg, help="store I/O threads (default: config)")
    p.add_argument("--drop-cache", choices=("auto", "drop_caches", "fadvise"), default="auto")
    p.add_argument("--json", metavar="F", help="also write the results as JSON")
    return p.parse_args(argv)


def store_config(args: argparse.Namespace) -> IOConfig:
    config = IOConfig.default()
    changes = {"block_bytes": args.block_size, "threads": args.threads}
    config = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    return dataclasses.replace(config, inflight=max(config.inflight, config.threads))


def engines(args: argparse.Namespace, config: IOConfig) -> list[tuple[Result, Engine]]:
    src = random_source(args.size)
    dst = aligned_empty((args.size,), torch.uint8, pin=False)
    store = Result(Setting("tierswap", config.block_bytes, config.threads))
    pairs: list[tuple[Result, Engine]] = [(store, StoreEngine(src, dst, config))]
    pairs.append((Result(Setting("dd", min(8 << 20, args.size))), DdEngine(args.size)))
    fio = which("fio")
    if fio is not None:
        fio_result = Result(
            Setting("fio", min(8 << 20, args.size)), note="O_DIRECT libaio 8 MiB qd32"
        )
        pairs.append((fio_result, FioEngine(args.size, binary=fio)))
    return pairs


def measure(args: argparse.Namespace, pairs: list[tuple[Result, Engine]]) -> set[str]:
    methods: set[str] = set()
    with bench_folder(args.dir) as root:
        for repeat in range(args.repeat):
            for result, engine in pairs:
                if result.skipped:
                    continue
                try:
                    sample, method = run_trial(engine, root, args.drop_cache)
                except BenchmarkError as exc:
                    result.skipped = str(exc)
                    continue
                result.samples.append(sample)
                methods.add(method)
                print(f"[{repeat + 1}/{args.repeat}] {result.setting.label}", file=sys.stderr)
    return methods


def paired_ratios(report: BenchReport) -> str:
    """Median over repeats of store / fio within the same repeat (robust to slow drift)."""
    store = report.results[0]
    if report.fio is None or len(store.samples) != len(report.fio.samples):
        return ""
    parts = []
    for direction in ("write", "read"):
        key = f"{direction}_bps"
        pairs = zip(store.samples, report.fio.samples, strict=True)
        ratios = [getattr(s, key) / getattr(f, key) for s, f in pairs]
        listed = " ".join(f"{r:.2f}" for r in ratios)
        parts.append(f"{direction} {statistics.median(ratios):.2f}x [{listed}]")
    return "paired per-repeat ratios to fio: " + ", ".join(parts)


def verdict(report: BenchReport) -> str:
    store = report.results[0]
    if not store.samples or report.fio is None:
        return "no fio figure: target (>= 0.95x fio) not evaluated"
    ratios = {d: report.ratio(getattr(store, d).median, d) or 0.0 for d in ("write", "read")}
    marks = {d: "PASS" if r >= TARGET else "FAIL" for d, r in ratios.items()}
    return ", ".join(f"{d} {ratios[d]:.2f}x fio {marks[d]}" for d in ("write", "read")) + (
        f" (target >= {TARGET}x)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_free_space(args.dir, args.size)
        config = store_config(args)
        pairs = engines(args, config)
        methods = measure(args, pairs)
    except TierswapError as exc:
        print(f"io_throughput: error: {exc}", file=sys.stderr)
        return 2
    fio = next((r for r, _ in pairs if r.setting.engine == "fio" and r.samples), None)
    results = [r for r, _ in pairs if r.setting.engine != "fio"]
    report = BenchReport(
        directory=str(args.dir.resolve()),
        size_bytes=args.size,
        repeat=args.repeat,
        cache_drop=" + ".join(sorted(methods)) or "-",
        results=results,
        fio=fio,
        fio_note=fio.note if fio else "not installed or failed",
    )
    results[0].note = "O_DIRECT" if getattr(pairs[0][1], "direct_used", False) else "buffered"
    print_table(report, sys.stdout)
    print(f"store {config}: {verdict(report)}")
    if paired := paired_ratios(report):
        print(paired)
    if args.json:
        write_json(report, args.json, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
