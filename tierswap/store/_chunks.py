"""The store's data path: chunk files written, read and checked through the I/O engine.

:class:`~tierswap.store.SwapStore` and its parts decide which file holds which chunk (staging,
recycled spares, commits, locks); this module moves the bytes: a whole chunk file per call, its
CRC32C computed on write and checked on every read, and a region of a chunk read or rewritten by
way of the whole chunk when the region covers it only partly (the checksum covers the whole
chunk). It counts the bytes it moves. Each folder of the store has its own I/O engine (its own
queue and threads), so a slow drive does not hold up a fast one; a chunk is moved by the engine
of the folder it lives in.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tierswap.config import IOConfig, round_up
from tierswap.errors import CorruptionError
from tierswap.io import IOEngine, aligned_empty, translate_os_error, zeros_crc
from tierswap.store._folder import StoreFolder
from tierswap.store._layout import ArrayMeta
from tierswap.store._tensors import flat_bytes, spare_bytes

__all__ = ["ChunkFiles", "ChunkRef", "ChunkTarget", "start_engines"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One chunk file and the checksum its bytes must have (captured under the store's lock)."""

    key: str
    index: int
    path: Path
    crc: int
    folder: int = 0  # the store folder holding the file (whose engine moves it)


@dataclasses.dataclass(frozen=True)
class ChunkTarget:
    """Where one chunk is written: the file ``path`` in store folder ``folder`` that will hold
    chunk ``index`` of ``key``; ``in_place`` overwrites an existing file of the chunk's size
    (a scratch store's chunk, or a recycled spare) without truncating it first."""

    key: str
    index: int
    path: Path
    folder: int = 0
    in_place: bool = False

    @property
    def name(self) -> str:
        """The chunk as error messages name it: key, index, file."""
        return _chunk_name(self.key, self.index, self.path)


def start_engines(config: IOConfig, folder: StoreFolder, *, writable: bool) -> list[IOEngine]:
    """One I/O engine per store folder, each probing O_DIRECT on its own folder (a writer in
    the private folder, a reader on the home's ``zarr.json`` or the folder's marker)."""
    engines: list[IOEngine] = []
    try:
        for index, member in enumerate(folder.folders):
            probe = member.internal if writable else member.internal / "zarr.json"
            if not writable and index == 0:
                probe = member.root / "zarr.json"
            engines.append(IOEngine(config, probe, writable=writable))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


class ChunkFiles:
    """Whole-chunk reads and writes of one store, checked and counted.

    Parameters
    ----------
    engines:
        The I/O engine of each store folder (its pool runs the calls on that folder's files;
        these methods run on its threads).
    sync_each_chunk:
        Per folder: fdatasync every file as it is written (durable buffered stores); otherwise
        the store makes chunks durable with one ``syncfs`` per commit phase.

    Thread safety: every method may be called from any thread; the counters take a lock.
    """

    def __init__(self, engines: list[IOEngine], *, sync_each_chunk: list[bool]) -> None:
        self.engines = list(engines)
        self.sync_each_chunk = list(sync_each_chunk)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(("bytes_read", "bytes_written", "reads", "writes"), 0)

    @property
    def engine(self) -> IOEngine:
        """The home folder's engine (the only one of a store on one folder)."""
        return self.engines[0]

    @engine.setter
    def engine(self, engine: IOEngine) -> None:
        self.engines[0] = engine

    def submit(self, folder: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the engine of store folder ``folder``."""
        return self.engines[folder].submit(fn, *args)

    # ------------------------------------------------------------------ whole chunks
    def write(self, target: ChunkTarget, piece: np.ndarray, file_size: int) -> int:
        """Write ``piece`` as ``target``'s file of ``file_size`` bytes; return its CRC. A
        failure raises an ``OSError`` naming the key and chunk."""
        engine, sync = self.engines[target.folder], self.sync_each_chunk[target.folder]
        try:
            crc = engine.write_file(
                target.path, piece, file_size, sync=sync, in_place=target.in_place
            )
        except OSError as exc:
            raise translate_os_error(exc, f"writing {target.name}") from exc
        self._count("bytes_written", piece.size, "writes")
        return crc

    def zero(self, target: ChunkTarget, length: int, file_size: int) -> int:
        """Create ``target``'s file as a sparse chunk of zeros; return the CRC of ``length``
        zero bytes. A failure raises an ``OSError`` naming the key and chunk."""
        engine, sync = self.engines[target.folder], self.sync_each_chunk[target.folder]
        try:
            engine.allocate_file(target.path, file_size, sync=sync)
        except OSError as exc:
            raise translate_os_error(exc, f"allocating {target.name}") from exc
        return zeros_crc(length)

    def read(self, chunk: ChunkRef, piece: np.ndarray, spare: int) -> None:
        """Fill ``piece`` from ``chunk`` and check its CRC32C (``spare``: see IOEngine).

        A failed read raises :class:`CorruptionError` (damaged, short or missing file) or the
        drive's ``OSError``, both naming the key and chunk; ``piece`` then holds no valid data.
        """
        try:
            crc = self.engines[chunk.folder].read_file(chunk.path, piece, spare)
        except CorruptionError as exc:
            raise CorruptionError(f"key {chunk.key!r} chunk {chunk.index}: {exc}") from exc
        except OSError as exc:
            where = _chunk_name(chunk.key, chunk.index, chunk.path)
            raise translate_os_error(exc, f"reading {where}") from exc
        if crc != chunk.crc:
            raise CorruptionError(
                f"key {chunk.key!r} chunk {chunk.index} ({str(chunk.path)!r}) fails its CRC32C "
                f"check (stored {chunk.crc:08x}, read {crc:08x}); the bytes on disk are "
                "damaged: restore the store from a copy or delete and rewrite the key"
            )
        self._count("bytes_read", piece.size, "reads")

    def verify(self, meta: ArrayMeta, chunk: ChunkRef) -> str | None:
        """What is wrong with ``chunk`` of ``meta``'s array (size or checksum), or ``None``."""
        _offset, length = meta.payload(chunk.index)
        try:
            size = chunk.path.stat().st_size
            if size != meta.chunk_bytes:
                return (
                    f"key {meta.key!r} chunk {chunk.index}: file {str(chunk.path)!r} has {size} "
                    f"bytes, expected {meta.chunk_bytes}"
                )
            self.read(chunk, _scratch_chunk(length), round_up(length) - length)
        except (CorruptionError, OSError) as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------------ regions
    def read_region(self, meta: ArrayMeta, chunk: ChunkRef, start: int, out: torch.Tensor) -> None:
        """Read the part of ``chunk`` that elements ``start..`` of ``out`` cover: straight into
        ``out`` when they cover it whole, else whole into a scratch buffer, then copied."""
        itemsize = meta.dtype.itemsize
        offset, length = meta.payload(chunk.index)
        lo, hi = _overlap(offset, length, start * itemsize, out.numel() * itemsize)
        flat = flat_bytes(out)
        base = start * itemsize
        if lo == offset and hi == offset + length:
            tail = spare_bytes(out) if hi - base == flat.size else 0
            self.read(chunk, flat[lo - base : hi - base], tail)
            return
        scratch = _scratch_chunk(length)
        self.read(chunk, scratch, round_up(length) - length)
        flat[lo - base : hi - base] = scratch[lo - offset : hi - offset]

    def write_region(
        self,
        meta: ArrayMeta,
        chunk: ChunkRef,
        target: tuple[Path, bool],
        start: int,
        source: torch.Tensor,
    ) -> int:
        """Write the new version of ``chunk`` to ``target`` (path, in place?) with ``source``
        (elements ``start..``) over it; a partly covered chunk is read and checked first, so
        its other bytes are kept and damage is never laundered into a new checksum."""
        itemsize = meta.dtype.itemsize
        offset, length = meta.payload(chunk.index)
        src, base = flat_bytes(source), start * itemsize
        lo, hi = _overlap(offset, length, base, src.size)
        if lo == offset and hi == offset + length:
            piece = src[lo - base : hi - base]
        else:
            piece = _scratch_chunk(length)
            self.read(chunk, piece, round_up(length) - length)
            piece[lo - offset : hi - offset] = src[lo - base : hi - base]
        path, in_place = target  # in place: a scratch store's chunk, or a recycled spare
        new = ChunkTarget(meta.key, chunk.index, path, chunk.folder, in_place)
        return self.write(new, piece, meta.chunk_bytes)

    # ------------------------------------------------------------------ counters
    def _count(self, bytes_name: str, nbytes: int, ops_name: str) -> None:
        with self._lock:
            self._counters[bytes_name] += nbytes
            self._counters[ops_name] += 1

    def stats(self) -> dict[str, int]:
        """Bytes and chunk files read and written so far."""
        with self._lock:
            return dict(self._counters)


def _chunk_name(key: str, index: int, path: Path) -> str:
    """How error messages name a chunk: its key and index, then the file."""
    return f"key {key!r} chunk {index} ({str(path)!r})"


def _overlap(offset: int, length: int, start: int, nbytes: int) -> tuple[int, int]:
    """Byte range shared by a chunk ``[offset, offset + length)`` and a region."""
    return max(offset, start), min(offset + length, start + nbytes)


def _scratch_chunk(length: int) -> np.ndarray:
    """A page-aligned buffer for a whole chunk (a partly covered one, or a verification)."""
    return aligned_empty((length,), torch.uint8, pin=False).numpy()
