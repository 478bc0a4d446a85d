"""The store's data path: chunk files written, read and checked through the I/O engine.

:class:`~tierswap.store.SwapStore` and its parts decide which file holds which chunk (staging,
recycled spares, commits, locks); this module moves the bytes: a whole chunk file per call, its
CRC32C computed on write and checked on every read, and a region of a chunk read or rewritten by
way of the whole chunk when the region covers it only partly (the checksum covers the whole
chunk). It counts the bytes it moves.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import torch

from tierswap.config import round_up
from tierswap.errors import CorruptionError
from tierswap.io import IOEngine, aligned_empty, translate_os_error, zeros_crc
from tierswap.store._layout import ArrayMeta
from tierswap.store._tensors import flat_bytes, spare_bytes

__all__ = ["ChunkFiles", "ChunkRef"]


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One chunk file and the checksum its bytes must have (captured under the store's lock)."""

    key: str
    index: int
    path: Path
    crc: int


class ChunkFiles:
    """Whole-chunk reads and writes of one store, checked and counted.

    Parameters
    ----------
    engine:
        The store's I/O engine (its pool runs the calls; these methods run on its threads).
    sync_each_chunk:
        fdatasync every file as it is written (durable buffered stores); otherwise the store
        makes chunks durable with one ``syncfs`` per commit phase.

    Thread safety: every method may be called from any thread; the counters take a lock.
    """

    def __init__(self, engine: IOEngine, *, sync_each_chunk: bool) -> None:
        self.engine = engine
        self.sync_each_chunk = sync_each_chunk
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(("bytes_read", "bytes_written", "reads", "writes"), 0)

    # ------------------------------------------------------------------ whole chunks
    def write(self, path: Path, piece: np.ndarray, file_size: int, in_place: bool = False) -> int:
        """Write ``piece`` as the chunk file ``path`` of ``file_size`` bytes; return its CRC."""
        try:
            crc = self.engine.write_file(
                path, piece, file_size, sync=self.sync_each_chunk, in_place=in_place
            )
        except OSError as exc:
            raise translate_os_error(exc, f"writing {str(path)!r}") from exc
        self._count("bytes_written", piece.size, "writes")
        return crc

    def zero(self, path: Path, length: int, file_size: int) -> int:
        """Create ``path`` as a sparse chunk of zeros; return the CRC of ``length`` zero bytes."""
        try:
            self.engine.allocate_file(path, file_size, sync=self.sync_each_chunk)
        except OSError as exc:
            raise translate_os_error(exc, f"allocating {str(path)!r}") from exc
        return zeros_crc(length)

    def read(self, chunk: ChunkRef, piece: np.ndarray, spare: int) -> None:
        """Fill ``piece`` from ``chunk`` and check its CRC32C (``spare``: see IOEngine)."""
        try:
            crc = self.engine.read_file(chunk.path, piece, spare)
        except CorruptionError as exc:
            raise CorruptionError(f"key {chunk.key!r} chunk {chunk.index}: {exc}") from exc
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
        return self.write(path, piece, meta.chunk_bytes, in_place=in_place)

    # ------------------------------------------------------------------ counters
    def _count(self, bytes_name: str, nbytes: int, ops_name: str) -> None:
        with self._lock:
            self._counters[bytes_name] += nbytes
            self._counters[ops_name] += 1

    def stats(self) -> dict[str, int]:
        """Bytes and chunk files read and written so far."""
        with self._lock:
            return dict(self._counters)


def _overlap(offset: int, length: int, start: int, nbytes: int) -> tuple[int, int]:
    """Byte range shared by a chunk ``[offset, offset + length)`` and a region."""
    return max(offset, start), min(offset + length, start + nbytes)


def _scratch_chunk(length: int) -> np.ndarray:
    """A page-aligned buffer for a whole chunk (a partly covered one, or a verification)."""
    return aligned_empty((length,), torch.uint8, pin=False).numpy()
