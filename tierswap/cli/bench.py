"""``tierswap bench``: what the disk under a folder can do, and which IOConfig drives it best.

Every setting (engine x block size x threads) writes ``--size`` bytes durably and reads them back
after the page cache was dropped, ``--repeat`` times, interleaved so that drift in the disk or in
other load on the machine spreads over all settings alike. fio runs on the same folder as the
reference when it is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tierswap.cli import _args
from tierswap.cli._engines import (
    AiofilesEngine,
    FioEngine,
    StoreEngine,
    ZarrEngine,
    which,
)
from tierswap.cli._measure import (
    GB,
    Engine,
    Setting,
    bench_folder,
    check_free_space,
    random_source,
    run_trial,
    short_size,
)
from tierswap.cli._plot import plot_report
from tierswap.cli._report import BenchReport, Result, print_table, write_json, write_tune_file
from tierswap.config import IOConfig
from tierswap.errors import BenchmarkError, ConfigError
from tierswap.io import aligned_empty

__all__ = ["ENGINES", "add_parser", "run"]

ENGINES = ("direct", "buffered", "aiofiles", "zarr")
DEFAULT_BLOCKS = "1MiB,4MiB,8MiB,16MiB"
DEFAULT_THREADS = "1,2,4,8"

_HELP = {
    "dir": "folder to measure (on the disk you will swap to); default: the current folder",
    "size": "bytes written and read per trial, e.g. 1GiB; the folder needs 2x free (default 1GiB)",
    "block-size": f"comma-separated request sizes, multiples of 4KiB (default {DEFAULT_BLOCKS})",
    "threads": f"comma-separated I/O thread counts (default {DEFAULT_THREADS})",
    "engine": (
        "comma-separated engines: direct and buffered are tierswap's store with O_DIRECT on / "
        "off, aiofiles and zarr are baselines (default: all four)"
    ),
    "repeat": "trials per setting; the table shows their median and min-max (default 3)",
    "json": "also write the results as JSON to this file ('-' prints JSON instead of the table)",
    "plot": "draw GB/s against block size per thread count into this PNG (needs matplotlib)",
    "tune": (
        "write the best tierswap setting to this config file; IOConfig.from_file and the "
        "TIERSWAP_CONFIG environment variable read it"
    ),
    "drop-cache": (
        "how to empty the page cache before reads: drop_caches (/proc/sys/vm/drop_caches, needs "
        "root), fadvise (posix_fadvise DONTNEED on the bench files), auto: the first that works"
    ),
    "no-fio": "skip the fio reference even when fio is installed",
}


def add_parser(commands: Any) -> None:
    """Register ``bench`` on the CLI's subparsers."""
    p = commands.add_parser(
        "bench",
        help="measure disk throughput and tune tierswap's I/O",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", type=Path, default=Path(), help=_HELP["dir"])
    p.add_argument("--size", type=_args.size, default="1GiB", help=_HELP["size"])
    p.add_argument(
        "--block-size", type=_args.size_list, default=DEFAULT_BLOCKS, help=_HELP["block-size"]
    )
    p.add_argument("--threads", type=_args.int_list, default=DEFAULT_THREADS, help=_HELP["threads"])
    p.add_argument(
        "--engine", type=_args.choice_list(ENGINES), default=",".join(ENGINES), help=_HELP["engine"]
    )
    p.add_argument("--repeat", type=_args.positive_int, default=3, help=_HELP["repeat"])
    p.add_argument("--json", metavar="F", help=_HELP["json"])
    p.add_argument("--plot", metavar="F.png", help=_HELP["plot"])
    p.add_argument("--tune", metavar="F", help=_HELP["tune"])
    p.add_argument(
        "--drop-cache",
        choices=("auto", "drop_caches", "fadvise"),
        default="auto",
        help=_HELP["drop-cache"],
    )
    p.add_argument("--no-fio", action="store_true", help=_HELP["no-fio"])
    p.set_defaults(run=run)


def _validate(args: argparse.Namespace) -> None:
    for block in args.block_size:
        if block % 4096:
            raise ConfigError(
                f"--block-size {block} is not a multiple of 4096 bytes; try e.g. 1MiB or 8MiB"
            )
    if args.size < 4096:
        raise ConfigError(f"--size {args.size} is below 4KiB; pass e.g. 64MiB or 1GiB")
    if args.tune and not set(args.engine) & {"direct", "buffered"}:
        raise ConfigError(
            "--tune picks among tierswap's engines; add direct or buffered to --engine"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError as exc:
            raise ConfigError("--plot needs matplotlib: pip install 'tierswap[bench]'") from exc
    if not args.dir.is_dir():
        raise ConfigError(f"--dir {str(args.dir)!r} is not a folder; create it or pass another one")
    check_free_space(args.dir, args.size)


def _make_engine(setting: Setting, src: Any, dst: Any) -> Engine:
    if setting.engine in ("direct", "buffered"):
        threads = setting.threads or 1
        io = IOConfig(
            block_bytes=setting.block_bytes,
            threads=threads,
            inflight=max(IOConfig().inflight, threads),
            direct="on" if setting.engine == "direct" else "off",
        )
        return StoreEngine(src, dst, io)
    if setting.engine == "aiofiles":
        return AiofilesEngine(src, dst, setting.block_bytes, setting.threads or 1)
    return ZarrEngine(src, setting.block_bytes, setting.threads or 1)


def plan(args: argparse.Namespace) -> list[Setting]:
    """The settings to measure, in the order each repeat runs them."""
    return [
        Setting(engine, block, threads)
        for engine in args.engine
        for block in args.block_size
        for threads in args.threads
    ]


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield ``done(text)``, called after each trial: a rich bar on stderr when it is a terminal."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError:
        enabled = False
    if not enabled:
        yield lambda text: None
        return
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("first trial", total=total)
        yield lambda text: bar.update(task, description=text, advance=1)


def _trial(result: Result, engine: Engine, root: Path, args: argparse.Namespace) -> str:
    """One trial of ``engine`` appended to ``result``; returns the cache-drop method used.

    An engine that cannot run here (fio failing, O_DIRECT refused) marks ``result`` skipped
    instead of ending the benchmark; every other error propagates.
    """
    if result.skipped:
        return ""
    try:
        sample, method = run_trial(engine, root, args.drop_cache)
    except BenchmarkError as exc:
        result.skipped = str(exc)
        return ""
    result.samples.append(sample)
    return method


def _describe(result: Result) -> str:
    if result.skipped or not result.samples:
        return f"{result.setting.label}: skipped"
    last = result.samples[-1]
    rates = f"write {last.write_bps / GB:.2f}, read {last.read_bps / GB:.2f} GB/s"
    return f"{result.setting.label}: {rates}"


def _store_note(setting: Setting, engine: Engine) -> str:
    direct = getattr(engine, "direct_used", None)
    if direct is None:
        return ""
    if setting.engine == "direct" and not direct:
        return "O_DIRECT refused by the filesystem: buffered"
    return "O_DIRECT" if direct else "buffered + fadvise"


def _measure(args: argparse.Namespace, report: BenchReport, fio: FioEngine | None) -> None:
    src = random_source(args.size)
    dst = aligned_empty((args.size,), torch.uint8, pin=False)
    engines = [_make_engine(r.setting, src, dst) for r in report.results]
    pairs: list[tuple[Result, Engine]] = list(zip(report.results, engines, strict=True))
    if fio is not None and report.fio is not None:
        pairs.append((report.fio, fio))
    total = args.repeat * len(pairs)
    methods: set[str] = set()
    with bench_folder(args.dir) as root, _progress(total, sys.stderr.isatty()) as done:
        for _ in range(args.repeat):
            for result, engine in pairs:
                methods.add(_trial(result, engine, root, args))
                done(_describe(result))
    for result, engine in zip(report.results, engines, strict=True):
        result.note = _store_note(result.setting, engine)
    report.cache_drop = " + ".join(sorted(methods - {""})) or "-"
    if report.fio is not None and report.fio.skipped:
        report.fio_note = f"failed: {report.fio.skipped}"
        report.fio = None


def _fio(args: argparse.Namespace) -> tuple[FioEngine | None, Result | None, str]:
    binary = None if args.no_fio else which("fio")
    if binary is None:
        return None, None, "skipped (--no-fio)" if args.no_fio else "not installed"
    engine = FioEngine(args.size, binary=binary)
    bs = min(engine.block_bytes, args.size // 4096 * 4096)
    note = f"O_DIRECT libaio {short_size(bs)} qd{engine.iodepth}"
    return engine, Result(Setting("fio", bs, None), note=note), note


def _emit(report: BenchReport, args: argparse.Namespace) -> None:
    if args.json != "-":
        print_table(report, sys.stdout)
    if args.json:
        write_json(report, args.json, sys.stdout)
    if args.plot:
        plot_report(report, args.plot)
        _say(args, f"plot written to {args.plot}")
    if args.tune:
        config = write_tune_file(report, args.tune)
        _say(
            args, f"tuned {config} written to {args.tune}; use it with TIERSWAP_CONFIG={args.tune}"
        )


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success (errors surface as TierswapError)."""
    _validate(args)
    fio_engine, fio_result, fio_note = _fio(args)
    report = BenchReport(
        directory=str(args.dir.resolve()),
        size_bytes=args.size,
        repeat=args.repeat,
        cache_drop="",
        results=[Result(s) for s in plan(args)],
        fio=fio_result,
        fio_note=fio_note,
    )
    _measure(args, report, fio_engine)
    _emit(report, args)
    return 0
