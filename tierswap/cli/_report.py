"""Benchmark results: per-setting samples, the medians table, JSON, the plot and the tune file."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from pathlib import Path
from typing import Any, TextIO

from tierswap.cli._measure import GB, Sample, Setting, Stats, short_size
from tierswap.config import IOConfig, format_size
from tierswap.errors import ConfigError

__all__ = [
    "TIERSWAP_ENGINES",
    "BenchReport",
    "Result",
    "best_result",
    "write_tune_file",
]

#: Engines that run tierswap's own I/O path (the ones ``--tune`` chooses among).
TIERSWAP_ENGINES = ("direct", "buffered")
JSON_VERSION = 1


@dataclasses.dataclass
class Result:
    """All samples of one setting. ``note`` says what actually ran (e.g. O_DIRECT or not)."""

    setting: Setting
    samples: list[Sample] = dataclasses.field(default_factory=list)
    note: str = ""
    skipped: str = ""

    @property
    def write(self) -> Stats:
        return Stats.of([s.write_bps for s in self.samples])

    @property
    def read(self) -> Stats:
        return Stats.of([s.read_bps for s in self.samples])

    @property
    def balanced_bps(self) -> float:
        """Harmonic mean of the write and read medians: what a swap step (both ways) sees."""
        w, r = self.write.median, self.read.median
        return 2 * w * r / (w + r)


@dataclasses.dataclass
class BenchReport:
    """Everything one ``tierswap bench`` run measured, plus how."""

    directory: str
    size_bytes: int
    repeat: int
    cache_drop: str
    results: list[Result]
    fio: Result | None = None
    fio_note: str = ""

    def ratio(self, value: float, direction: str) -> float | None:
        """``value`` over fio's median in ``direction``; None without a fio figure."""
        if self.fio is None or not self.fio.samples:
            return None
        stats: Stats = getattr(self.fio, direction)
        return value / stats.median

    def to_json(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "dir": self.directory,
            "size_bytes": self.size_bytes,
            "repeat": self.repeat,
            "cache_drop": self.cache_drop,
            "units": "GB/s (1e9 bytes per second)",
            "fio": self._result_json(self.fio) if self.fio and self.fio.samples else None,
            "fio_note": self.fio_note,
            "results": [self._result_json(r) for r in self.results if r.samples],
            "skipped": [
                {**dataclasses.asdict(r.setting), "reason": r.skipped}
                for r in self.results
                if r.skipped
            ],
        }

    def _result_json(self, result: Result) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "engine": result.setting.engine,
            "block_bytes": result.setting.block_bytes,
            "threads": result.setting.threads,
            "note": result.note,
        }
        for direction in ("write", "read"):
            stats: Stats = getattr(result, direction)
            samples = [_gbps(getattr(s, f"{direction}_bps")) for s in result.samples]
            entry[direction] = {
                "median_gbps": _gbps(stats.median),
                "min_gbps": _gbps(stats.low),
                "max_gbps": _gbps(stats.high),
                "samples_gbps": samples,
                "ratio_to_fio": _round(self.ratio(stats.median, direction)),
            }
        return entry

    def rows(self) -> list[list[str]]:
        """Table rows: engine, block, threads, then figure and ratio for write and read."""
        shown = [r for r in self.results if r.samples]
        if self.fio is not None and self.fio.samples:
            shown.append(self.fio)
        return [self._row(r) for r in shown]

    def _row(self, result: Result) -> list[str]:
        setting = result.setting
        threads = "-" if setting.threads is None else str(setting.threads)
        row = [setting.engine, short_size(setting.block_bytes), threads]
        for direction in ("write", "read"):
            stats: Stats = getattr(result, direction)
            row.append(f"{stats.median / GB:.2f} ({stats.low / GB:.2f}-{stats.high / GB:.2f})")
            ratio = self.ratio(stats.median, direction)
            row.append("-" if ratio is None else f"{ratio:.2f}x")
        return row

    def caption(self) -> str:
        fio = "fio: " + (self.fio_note or "-")
        return (
            f"{format_size(self.size_bytes)} per trial in {self.directory}, median of "
            f"{self.repeat} (min-max) in GB/s; page cache dropped by {self.cache_drop}; {fio}"
        )


def _gbps(bps: float) -> float:
    return round(bps / GB, 4)


def _round(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio, 4)


HEADERS = ["engine", "block", "threads", "write GB/s", "x fio", "read GB/s", "x fio"]


def print_table(report: BenchReport, stream: TextIO) -> None:
    """The medians table: rich when installed, aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is in the `bench` extra; plain text does the same job.
        _print_plain(report, stream)
        return
    table = Table(*HEADERS, caption=report.caption(), title="tierswap bench")
    for row in report.rows():
        table.add_row(*row)
    Console(file=stream, width=max(100, len(report.caption()) // 2 + 10)).print(table)
    _print_skipped(report, stream)


def _print_skipped(report: BenchReport, stream: TextIO) -> None:
    for result in report.results:
        if result.skipped:
            print(f"skipped {result.setting.label}: {result.skipped}", file=stream)


def _print_plain(report: BenchReport, stream: TextIO) -> None:
    rows = [HEADERS, *report.rows()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)),
            file=stream,
        )
    print(report.caption(), file=stream)


def write_json(report: BenchReport, path: str, stream: TextIO) -> None:
    """Write the report as JSON to ``path`` ("-" for ``stream``)."""
    text = json.dumps(report.to_json(), indent=2) + "\n"
    if path == "-":
        stream.write(text)
    else:
        Path(path).write_text(text)


def best_result(report: BenchReport) -> Result:
    """The tierswap setting with the best balanced (read and write) throughput."""
    candidates = [r for r in report.results if r.setting.engine in TIERSWAP_ENGINES and r.samples]
    if not candidates:
        raise ConfigError(
            "--tune needs at least one tierswap engine measured; add direct or buffered to --engine"
        )
    return max(candidates, key=lambda r: r.balanced_bps)


def write_tune_file(report: BenchReport, path: str | Path) -> IOConfig:
    """Write the best setting as an IOConfig file (``IOConfig.from_file`` reads it back)."""
    best = best_result(report)
    threads = best.setting.threads or IOConfig().threads
    config = IOConfig(
        block_bytes=best.setting.block_bytes,
        threads=threads,
        inflight=max(IOConfig().inflight, threads),
        # "auto" re-probes O_DIRECT where the file is used: same choice on this disk, and a
        # buffered fallback instead of an error if the file is reused on another filesystem.
        direct="auto" if best.setting.engine == "direct" else "off",
    )
    measured = {
        "engine": best.setting.engine,
        "dir": report.directory,
        "size_bytes": report.size_bytes,
        "write_gbps": _gbps(best.write.median),
        "read_gbps": _gbps(best.read.median),
        "write_ratio_to_fio": _round(report.ratio(best.write.median, "write")),
        "read_ratio_to_fio": _round(report.ratio(best.read.median, "read")),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    config.to_file(path, measured=measured)
    return config
