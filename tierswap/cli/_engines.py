"""The engines ``tierswap bench`` times: tierswap's store and the baselines it is judged against.

- ``direct`` / ``buffered``: tierswap's own path, ``SwapStore.put`` + ``commit`` (durable) and
  ``get`` into a page-aligned buffer, with ``IOConfig(block_bytes, threads, direct="on"|"off")``.
- ``aiofiles``: asyncio writes / reads of the same bytes, one task and file handle per
  contiguous segment, fsynced at the end.
- ``zarr``: zarr-python's own array API (``zarr.create_array`` with one uncompressed chunk per
  block, ``array[:] = data``, ``array[:]``), the written files fsynced.
- ``fio`` (O_DIRECT, libaio, iodepth 32, end_fsync) and ``dd`` (``oflag=direct`` /
  ``iflag=direct``, ``conv=fsync``): the operating system's ceiling, run as subprocesses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import numpy as np
import torch
import zarr

from tierswap.cli._measure import elapsed, fsync_tree
from tierswap.config import ALIGN, IOConfig, round_up
from tierswap.errors import BenchmarkError, ConfigError
from tierswap.store import SwapStore

__all__ = [
    "AiofilesEngine",
    "DdEngine",
    "FioEngine",
    "StoreEngine",
    "ZarrEngine",
    "parse_fio_json",
    "which",
]

_KEY = "bench/tensor"
DEFAULT_CHUNK = 16 << 20
_FILE = "data.bin"
#: fio's settings for the reference figure (what the issue and docs compare against).
FIO_BLOCK = 8 << 20
FIO_IODEPTH = 32


def which(tool: str) -> str | None:
    """Path of the executable ``tool`` or None (a seam the tests patch to hide fio)."""
    return shutil.which(tool)


@dataclasses.dataclass
class StoreEngine:
    """tierswap's engine through the store: put + durable commit, then get into ``dst``.

    ``direct_used`` records what the store reported (``store.direct``) on the last write.
    """

    src: torch.Tensor
    dst: torch.Tensor
    io: IOConfig
    direct_used: bool | None = None

    @property
    def chunk_bytes(self) -> int:
        """The store's default chunk size, or one block when blocks are larger (a request never
        spans two chunk files, so a smaller chunk would cap the block size)."""
        return max(DEFAULT_CHUNK, self.io.block_bytes)

    def write(self, folder: Path) -> float:
        try:
            store = SwapStore(
                folder / "store", mode="w", durable=True, io=self.io, chunk_bytes=self.chunk_bytes
            )
        except ConfigError as exc:  # direct="on" on a filesystem that refuses O_DIRECT
            raise BenchmarkError(str(exc)) from exc
        try:

            def run() -> None:
                store.put(_KEY, self.src)
                store.commit()

            seconds = elapsed(run)
            self.direct_used = store.direct
        finally:
            store.close()
        return self.src.numel() / seconds

    def read(self, folder: Path) -> float:
        with SwapStore(folder / "store", mode="r", io=self.io) as store:
            seconds = elapsed(lambda: store.get(_KEY, out=self.dst))
        return self.dst.numel() / seconds


def _segments(nbytes: int, parts: int, block: int) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into at most ``parts`` contiguous block-aligned ranges."""
    per = max(block, round_up(-(-nbytes // parts), block))
    return [(start, min(start + per, nbytes)) for start in range(0, nbytes, per)]


@dataclasses.dataclass
class AiofilesEngine:
    """aiofiles baseline: ``threads`` asyncio tasks, each on its own segment and file handle."""

    src: torch.Tensor
    dst: torch.Tensor
    block_bytes: int
    threads: int

    def write(self, folder: Path) -> float:
        path = folder / _FILE
        return self.src.numel() / elapsed(lambda: self._run(self._write(path)))

    def read(self, folder: Path) -> float:
        path = folder / _FILE
        return self.dst.numel() / elapsed(lambda: self._run(self._read(path)))

    def _run(self, coro: Any) -> None:
        async def with_pool() -> None:
            # aiofiles runs each call on the loop's default executor; size it to the task count.
            pool = concurrent.futures.ThreadPoolExecutor(self.threads, "tierswap-bench-aio")
            asyncio.get_running_loop().set_default_executor(pool)
            await coro

        asyncio.run(with_pool())

    async def _write(self, path: Path) -> None:
        view = self.src.numpy().data
        async with aiofiles.open(path, "wb") as f:
            await f.truncate(len(view))
        parts = _segments(len(view), self.threads, self.block_bytes)
        await asyncio.gather(*(self._write_part(path, view, lo, hi) for lo, hi in parts))
        async with aiofiles.open(path, "rb") as f:
            await aiofiles.os.wrap(os.fsync)(f.fileno())

    async def _write_part(self, path: Path, view: memoryview, lo: int, hi: int) -> None:
        async with aiofiles.open(path, "r+b") as f:
            await f.seek(lo)
            for start in range(lo, hi, self.block_bytes):
                await f.write(view[start : min(start + self.block_bytes, hi)])

    async def _read(self, path: Path) -> None:
        view = self.dst.numpy().data
        parts = _segments(len(view), self.threads, self.block_bytes)
        await asyncio.gather(*(self._read_part(path, view, lo, hi) for lo, hi in parts))

    async def _read_part(self, path: Path, view: memoryview, lo: int, hi: int) -> None:
        async with aiofiles.open(path, "rb", buffering=0) as f:
            await f.seek(lo)
            pos = lo
            while pos < hi:
                got = await f.readinto(view[pos : min(pos + self.block_bytes, hi)])
                if not got:
                    raise BenchmarkError(f"aiofiles read of {path} ended early at byte {pos}")
                pos += got


@dataclasses.dataclass
class ZarrEngine:
    """zarr-python baseline: one 1-D uint8 array, one uncompressed chunk per block."""

    src: torch.Tensor
    block_bytes: int
    threads: int

    def _config(self) -> Any:
        return zarr.config.set({"async.concurrency": self.threads})

    def write(self, folder: Path) -> float:
        data = self.src.numpy()

        def run() -> None:
            with self._config():
                array = zarr.create_array(
                    store=str(folder / "zarr"),
                    shape=data.shape,
                    chunks=(self.block_bytes,),
                    dtype="uint8",
                    compressors=None,
                    filters=None,
                    fill_value=0,
                )
                array[:] = data
            fsync_tree(folder / "zarr")

        return data.size / elapsed(run)

    def read(self, folder: Path) -> float:
        out: list[np.ndarray] = []

        def run() -> None:
            with self._config():
                out.append(np.asarray(zarr.open_array(str(folder / "zarr"), mode="r")[:]))

        seconds = elapsed(run)
        return out[0].size / seconds


def _fit(nbytes: int, block: int) -> tuple[int, int]:
    """(block size, total bytes) for a tool moving whole blocks of at most ``block`` bytes."""
    bs = min(block, nbytes // ALIGN * ALIGN)
    if bs <= 0:
        raise BenchmarkError(f"--size {nbytes} is below one {ALIGN}-byte block; pass >= 4KiB")
    return bs, nbytes // bs * bs


def _check_run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()[-3:]
        raise BenchmarkError(
            f"{cmd[0]} failed (exit {exc.returncode}): {' | '.join(detail)}"
        ) from exc
    except OSError as exc:
        raise BenchmarkError(f"cannot run {cmd[0]}: {exc}") from exc


def parse_fio_json(text: str, rw: str) -> float:
    """Bytes per second of the first job's ``rw`` ("read" or "write") in fio's JSON output.

    fio may print warnings around the JSON object; they are skipped.
    """
    start = text.find("{")
    if start < 0:
        raise BenchmarkError(f"fio printed no JSON: {text[:200]!r}")
    try:  # raw_decode: fio may also print lines after the object
        job = json.JSONDecoder().raw_decode(text, start)[0]["jobs"][0]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchmarkError(f"fio printed no job results as JSON: {text[:200]!r}") from exc
    if job.get("error"):
        raise BenchmarkError(f"fio reported error {job['error']} for {rw}")
    rate = float(job[rw]["bw_bytes"])
    if rate <= 0:
        raise BenchmarkError(f"fio moved no bytes for {rw}; is --size at least one block?")
    return rate


@dataclasses.dataclass
class FioEngine:
    """fio reference: O_DIRECT, libaio, 8 MiB blocks, iodepth 32, fsync at the end."""

    nbytes: int
    binary: str = "fio"
    block_bytes: int = FIO_BLOCK
    iodepth: int = FIO_IODEPTH

    def command(self, folder: Path, rw: str) -> list[str]:
        bs, size = _fit(self.nbytes, self.block_bytes)
        return [
            self.binary,
            "--name=tierswap-bench",
            f"--filename={folder / _FILE}",
            f"--rw={rw}",
            f"--bs={bs}",
            f"--size={size}",
            "--direct=1",
            "--ioengine=libaio",
            f"--iodepth={self.iodepth}",
            "--end_fsync=1",
            "--output-format=json",
        ]

    def write(self, folder: Path) -> float:
        return parse_fio_json(_check_run(self.command(folder, "write")).stdout, "write")

    def read(self, folder: Path) -> float:
        return parse_fio_json(_check_run(self.command(folder, "read")).stdout, "read")


@dataclasses.dataclass
class DdEngine:
    """dd reference: ``oflag=direct conv=fsync`` writes and ``iflag=direct`` reads."""

    nbytes: int
    block_bytes: int = FIO_BLOCK
    binary: str = "dd"

    def write(self, folder: Path) -> float:
        bs, size = _fit(self.nbytes, self.block_bytes)
        cmd = [self.binary, "if=/dev/zero", f"of={folder / _FILE}", f"bs={bs}"]
        cmd += [f"count={size // bs}", "oflag=direct", "conv=fsync", "status=none"]
        return size / elapsed(lambda: _check_run(cmd))

    def read(self, folder: Path) -> float:
        bs, size = _fit(self.nbytes, self.block_bytes)
        cmd = [self.binary, f"if={folder / _FILE}", "of=/dev/null", f"bs={bs}"]
        cmd += [f"count={size // bs}", "iflag=direct", "status=none"]
        return size / elapsed(lambda: _check_run(cmd))
