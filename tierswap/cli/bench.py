"""``tierswap bench``: what the disk under a folder can do, and which IOConfig drives it best.

Every setting (engine x block size x threads) writes ``--size`` bytes durably and reads them back
after the page cache was dropped, ``--repeat`` times, interleaved so that drift in the disk or in
other load on the machine spreads over all settings alike. fio runs on the same folder as the
reference when it is installed.

Several ``--dir`` (one folder per drive) are measured one after the other within each repeat,
then a store striped over all of them is measured against each folder alone; ``--tune`` then
also writes each folder's weight (see :mod:`tierswap.cli._striped`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tierswap.cli import _args, _striped
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
    Sample,
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
    "dir": (
        "folder to measure (on the disk you will swap to); default: the current folder. Repeat "
        "it for a swap_dir on several drives (--dir A --dir B): each folder is measured, then "
        "one store striped over all of them, and --tune also writes each folder's weight"
    ),
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
    p.add_argument("--dir", type=Path, action="append", help=_HELP["dir"])
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
    for folder in args.dir:
        if not folder.is_dir():
            raise ConfigError(
                f"--dir {str(folder)!r} is not a folder; create it or pass another one"
            )
        check_free_space(folder, args.size)
    resolved = [folder.resolve() for folder in args.dir]
    if len(set(resolved)) != len(resolved):
        raise ConfigError("a folder is given twice to --dir; pass each folder once")


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


def _measure(
    args: argparse.Namespace,
    reports: Sequence[BenchReport],
    fios: Sequence[FioEngine | None],
) -> _striped.Striped | None:
    """Every setting in every folder, interleaved; then, for several folders, the striped
    store against each folder alone (``None`` for one folder)."""
    src = random_source(args.size)
    dst = aligned_empty((args.size,), torch.uint8, pin=False)
    plans = [_pairs(report, fio, src, dst) for report, fio in zip(reports, fios, strict=True)]
    total = args.repeat * sum(len(pairs) for pairs in plans)
    several = len(reports) > 1 and set(args.engine) & {"direct", "buffered"}
    total += args.repeat * (len(reports) + 1) if several else 0
    methods: list[set[str]] = [set() for _ in reports]
    with contextlib.ExitStack() as stack:
        roots = [stack.enter_context(bench_folder(folder)) for folder in args.dir]
        done = stack.enter_context(_progress(total, sys.stderr.isatty()))
        for _ in range(args.repeat):
            for pairs, root, used in zip(plans, roots, methods, strict=True):
                for result, engine in pairs:
                    used.add(_trial(result, engine, root, args))
                    done(_describe(result))
        for report, pairs, used in zip(reports, plans, methods, strict=True):
            _finish(report, pairs, used)
        if not several:
            return None

        def single(setting: Setting, root: Path) -> Sample:
            sample, _method = run_trial(_make_engine(setting, src, dst), root, args.drop_cache)
            done(f"{setting.label} alone")
            return sample

        try:
            return _striped.measure(
                list(reports), src, dst, roots, repeat=args.repeat, drop=args.drop_cache,
                single=single,
            )  # fmt: skip
        except ConfigError as exc:  # no tierswap setting ran in every folder
            print(f"tierswap bench: striped store not measured: {exc}", file=sys.stderr)
            return None


def _pairs(
    report: BenchReport, fio: FioEngine | None, src: torch.Tensor, dst: torch.Tensor
) -> list[tuple[Result, Engine]]:
    engines = [_make_engine(r.setting, src, dst) for r in report.results]
    pairs: list[tuple[Result, Engine]] = list(zip(report.results, engines, strict=True))
    if fio is not None and report.fio is not None:
        pairs.append((report.fio, fio))
    return pairs


def _finish(report: BenchReport, pairs: list[tuple[Result, Engine]], methods: set[str]) -> None:
    """Notes, cache-drop method and fio's verdict of one folder's report."""
    for result, engine in pairs:
        if result is not report.fio:
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


def _emit(
    reports: list[BenchReport], striped: _striped.Striped | None, args: argparse.Namespace
) -> None:
    if args.json != "-":
        for report in reports:
            print_table(report, sys.stdout)
        if striped is not None:
            _print_striped(striped)
    if args.json:
        _write_json(reports, striped, args.json)
    if args.plot:
        for report, path in zip(reports, _plot_paths(args.plot, len(reports)), strict=True):
            plot_report(report, path)
            _say(args, f"plot written to {path}")
    if args.tune:
        if striped is not None:
            config = _striped.write_tune_file(striped, args.tune)
        else:
            config = write_tune_file(reports[0], args.tune)
        _say(
            args, f"tuned {config} written to {args.tune}; use it with TIERSWAP_CONFIG={args.tune}"
        )


def _print_striped(striped: _striped.Striped) -> None:
    setting = striped.setting
    print(f"\nseveral folders, {setting.label} (median of each folder alone, and striped):")
    rows = striped.rows()
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _write_json(reports: list[BenchReport], striped: _striped.Striped | None, path: str) -> None:
    if striped is None:
        write_json(reports[0], path, sys.stdout)
        return
    data = {"dirs": [r.to_json() for r in reports], "several": striped.to_json()}
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def _plot_paths(path: str, count: int) -> list[Path]:
    """``path`` for one folder; ``<stem>-<i><suffix>`` for each of several."""
    base = Path(path)
    if count == 1:
        return [base]
    return [base.with_name(f"{base.stem}-{i}{base.suffix}") for i in range(count)]


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success (errors surface as TierswapError)."""
    args.dir = args.dir or [Path()]
    _validate(args)
    reports, fios = [], []
    for folder in args.dir:
        fio_engine, fio_result, fio_note = _fio(args)
        reports.append(
            BenchReport(
                directory=str(folder.resolve()),
                size_bytes=args.size,
                repeat=args.repeat,
                cache_drop="",
                results=[Result(s) for s in plan(args)],
                fio=fio_result,
                fio_note=fio_note,
            )
        )
        fios.append(fio_engine)
    striped = _measure(args, reports, fios)
    _emit(reports, striped, args)
    return 0
