"""Shared throughput measurement: settings, samples, page-cache dropping, free space, clean-up.

``tierswap bench`` and ``bench/io_throughput.py`` both time engines through this module, so the
two report the same thing the same way: a write is timed until its data is durable (fsynced), a
read starts after the page cache was dropped, and a rate is bytes per second of wall-clock time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from tierswap.config import format_size
from tierswap.errors import ConfigError
from tierswap.io import aligned_empty

__all__ = [
    "GB",
    "DropMethod",
    "Engine",
    "Sample",
    "Setting",
    "Stats",
    "bench_folder",
    "check_free_space",
    "drop_page_cache",
    "elapsed",
    "fsync_tree",
    "random_source",
    "run_trial",
    "short_size",
]

#: Rates are reported in GB/s with GB = 10**9 bytes, as fio and dd print them.
GB = 1e9
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_BENCH_PREFIX = "tierswap-bench-"

DropMethod = Literal["auto", "drop_caches", "fadvise"]


def short_size(nbytes: int) -> str:
    """``8 MiB``, ``512 KiB``, ``1.5 MiB``: block sizes as people write them."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One measured configuration: an engine and the request size / concurrency it runs with.

    ``threads`` is ``None`` for engines whose concurrency is fixed by their own options (fio's
    iodepth, dd's single stream).
    """

    engine: str
    block_bytes: int
    threads: int | None = None

    @property
    def label(self) -> str:
        threads = "-" if self.threads is None else str(self.threads)
        return f"{self.engine} {short_size(self.block_bytes)} x{threads}"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One write-then-read trial: rates in bytes per second."""

    write_bps: float
    read_bps: float


@dataclasses.dataclass(frozen=True)
class Stats:
    """Median, minimum and maximum of a series of rates (bytes per second)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, rates: list[float]) -> Stats:
        if not rates:
            raise ValueError("Stats.of needs at least one rate")
        return cls(statistics.median(rates), min(rates), max(rates))


class Engine(Protocol):
    """Something that writes its bytes durably into a folder and reads them back.

    Both methods return a rate in bytes per second: the bytes moved over the timed part, which
    ends once a write is durable (fsynced) and once a read's bytes are in memory.
    """

    def write(self, folder: Path) -> float: ...

    def read(self, folder: Path) -> float: ...


def random_source(nbytes: int, *, seed: int = 0) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``nbytes`` random bytes (incompressible, like real state)."""
    src = aligned_empty((nbytes,), torch.uint8, pin=False)
    rng = np.random.default_rng(seed)
    step = 64 << 20
    for start in range(0, nbytes, step):
        end = min(start + step, nbytes)
        src[start:end] = torch.frombuffer(bytearray(rng.bytes(end - start)), dtype=torch.uint8)
    return src


def check_free_space(folder: Path, size: int, *, factor: int = 2) -> None:
    """Raise ConfigError unless ``folder`` has ``factor`` x ``size`` bytes free."""
    free = shutil.disk_usage(folder).free
    need = factor * size
    if free < need:
        raise ConfigError(
            f"--dir {str(folder)!r} has {format_size(free)} free but the benchmark needs "
            f"{factor} x --size = {format_size(need)}; pass a smaller --size or another --dir"
        )


@contextlib.contextmanager
def bench_folder(parent: Path) -> Iterator[Path]:
    """A fresh folder under ``parent`` that is removed on exit, Ctrl-C included."""
    if not parent.is_dir():
        raise ConfigError(f"--dir {str(parent)!r} is not a folder; create it or pass another one")
    root = Path(tempfile.mkdtemp(prefix=_BENCH_PREFIX, dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _regular_files(folder: Path) -> Iterator[Path]:
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            yield Path(dirpath, name)


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` and the folders themselves (what "durable" costs)."""
    for path in _regular_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for dirpath, _dirs, _files in os.walk(folder):
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fadvise_tree(folder: Path) -> None:
    for path in _regular_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages; make them clean first.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache(folder: Path, method: DropMethod = "auto") -> str:
    """Evict ``folder``'s files from the page cache; return the method that worked.

    ``"drop_caches"`` writes 1 to /proc/sys/vm/drop_caches (the whole machine's clean page cache;
    needs root and a writable /proc/sys). ``"fadvise"`` fsyncs each file under ``folder`` and
    calls ``posix_fadvise(DONTNEED)`` on it. ``"auto"`` tries the first, then the second.
    """
    if method in ("auto", "drop_caches"):
        fsync_tree(folder)
        try:
            _DROP_CACHES.write_text("1\n")
        except OSError as exc:
            if method == "drop_caches":
                raise ConfigError(
                    f"cannot write {_DROP_CACHES} ({exc.strerror}); use --drop-cache fadvise"
                ) from exc
        else:
            return "drop_caches"
    _fadvise_tree(folder)
    return "fadvise"


def run_trial(engine: Engine, root: Path, drop: DropMethod = "auto") -> tuple[Sample, str]:
    """Write with ``engine`` into a fresh folder, drop the cache, read back, remove the folder.

    Returns the sample and the cache-drop method that was used.
    """
    folder = Path(tempfile.mkdtemp(prefix="trial-", dir=root))
    try:
        write_bps = engine.write(folder)
        used = drop_page_cache(folder, drop)
        read_bps = engine.read(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Sample(write_bps, read_bps), used


def elapsed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes (wall clock, ``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
