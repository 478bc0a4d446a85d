"""The I/O engine: a bounded pool of threads doing large positional reads and writes.

Each request moves one whole file (a chunk file) in ``block_bytes`` pieces with ``os.preadv`` /
``os.pwritev``, which release the GIL, so several requests run in parallel. With O_DIRECT the page
cache is bypassed; buffers that are not page-aligned go through a per-thread aligned bounce buffer.
Without O_DIRECT (tmpfs, some network filesystems) writes are buffered and the pages are dropped
with ``posix_fadvise(DONTNEED)`` afterwards, so swapped state does not crowd the page cache.

A CRC32C of each file's payload is computed block by block while the block is hot in cache.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import numpy as np

from tierswap.config import ALIGN, IOConfig, round_up
from tierswap.errors import ConfigError, CorruptionError, OutOfSpaceError, TierswapError

__all__ = ["IOEngine", "crc_of", "gather", "translate_os_error", "zeros_crc"]

T = TypeVar("T")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: Largest bounce buffer per I/O thread: unaligned data moves in pieces of this size.
BOUNCE_BYTES = 1 << 20


def crc_of(data: np.ndarray, value: int = 0) -> int:
    """CRC32C of a uint8 array (continuing from ``value``)."""
    return crc32c.crc32c(data.data, value) if data.size else value


@functools.lru_cache(maxsize=64)
def zeros_crc(length: int) -> int:
    """CRC32C of ``length`` zero bytes (cached: arrays repeat a few chunk lengths)."""
    block = np.zeros(min(length, 1 << 20), dtype=np.uint8)
    crc = 0
    for offset in range(0, length, block.size):
        crc = crc_of(block[: min(block.size, length - offset)], crc)
    return crc


def translate_os_error(exc: OSError, what: str) -> OSError:
    """The error to raise (``from exc``) for ``exc``, met while doing ``what``.

    ``what`` names the operation and its object, e.g. ``"writing key 'a' chunk 0 ('/s/c/0')"``.
    A full disk becomes :class:`OutOfSpaceError`; tierswap's own errors pass through unchanged;
    any other ``OSError`` (``EIO`` from a failing drive, ...) becomes an ``OSError`` of the
    same errno, and so of the same builtin subclass, whose message ends with ``what``: the OS
    names no file for a failed ``pwritev`` or ``fdatasync``, and the caller's key is the name
    that tells the user which state was hit.
    """
    if isinstance(exc, TierswapError):
        return exc
    if exc.errno in _NO_SPACE:
        return OutOfSpaceError(f"disk full while {what}; free space on that filesystem and retry")
    if exc.errno is None:
        return OSError(f"{exc} while {what}")
    return OSError(exc.errno, f"{exc.strerror or os.strerror(exc.errno)} while {what}")


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


class IOEngine:
    """Bounded thread pool of whole-file positional reads and writes.

    Parameters
    ----------
    config:
        Threads, requests in flight, block size and the O_DIRECT choice.
    probe:
        Where O_DIRECT is tried (``config.direct`` "auto" or "on"): a folder in which a
        scratch file is written (``writable``), else an existing file whose first page is read.
    writable:
        Whether the engine writes (probe by writing) or only reads.

    Thread safety: every public method may be called from any thread. At most
    ``config.inflight`` requests are queued or running; :meth:`submit` blocks beyond that.
    """

    def __init__(self, config: IOConfig, probe: Path, *, writable: bool = True) -> None:
        self.config = config
        self.direct = self._probe_direct(probe, writable)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="tierswap-io")
        self._slots = threading.BoundedSemaphore(config.inflight)
        self._local = threading.local()
        self._closed = False

    # ------------------------------------------------------------------ set-up
    def _probe_direct(self, probe: Path, writable: bool) -> bool:
        """Whether O_DIRECT works where this engine reads and writes: ``probe`` is a folder
        to write a scratch file in (``writable``), else an existing file to read."""
        if self.config.direct == "off" or not _O_DIRECT:
            return False
        ok = _probe_write(probe) if writable else _probe_read(probe)
        if not ok and self.config.direct == "on":
            raise ConfigError(
                f"direct='on' but the filesystem of {str(probe)!r} rejects O_DIRECT; "
                "use direct='auto' or 'off'"
            )
        return ok

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The worker pool (for small jobs that should run beside the I/O)."""
        return self._pool

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a worker; blocks while ``inflight`` requests are outstanding."""
        self._slots.acquire()
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _f: self._slots.release())
        return future

    def close(self) -> None:
        """Wait for running requests and stop the workers."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ writes
    def write_file(
        self,
        path: Path,
        src: np.ndarray,
        file_size: int,
        *,
        sync: bool = True,
        in_place: bool = False,
    ) -> int:
        """Write ``src`` (uint8) at offset 0 of a new ``path`` of ``file_size`` bytes; return CRC.

        Bytes past ``src`` up to ``file_size`` read as zeros (a padded edge chunk).
        ``in_place`` overwrites an existing file of that size without truncating it first, so
        the filesystem reuses its blocks instead of allocating new ones.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (0 if in_place else os.O_TRUNC)
        fd = self._open(path, flags)
        try:
            crc = self._write_blocks(fd, src)
            if os.fstat(fd).st_size != file_size:
                os.ftruncate(fd, file_size)
            if sync:
                os.fdatasync(fd)
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return crc
        finally:
            os.close(fd)

    def allocate_file(self, path: Path, file_size: int, *, sync: bool = True) -> None:
        """Create ``path`` as ``file_size`` bytes of zeros without writing them (a sparse file)."""
        fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, file_size)
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write_blocks(self, fd: int, src: np.ndarray) -> int:
        crc = 0
        block = self._block_for(src)
        for offset in range(0, src.size, block):
            piece = src[offset : offset + block]
            crc = crc_of(piece, crc)
            self._pwrite_all(fd, self._writable_view(piece), offset)
        return crc

    def _writable_view(self, piece: np.ndarray) -> np.ndarray:
        """``piece`` itself when O_DIRECT can take it, else an aligned, zero-padded copy."""
        if not self.direct or (_address(piece) % ALIGN == 0 and piece.size % ALIGN == 0):
            return piece
        bounce = self._bounce(round_up(piece.size))
        bounce[: piece.size] = piece
        bounce[piece.size :] = 0
        return bounce

    @staticmethod
    def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
        """Write all of ``data`` at ``offset``: a short write is continued where it stopped; a
        write that makes no progress raises ``EIO`` (looping on it would never end)."""
        view = data.data.cast("B")
        while view:
            written = os.pwritev(fd, [view], offset)
            if written <= 0:
                raise OSError(
                    errno.EIO, f"the drive wrote 0 of {len(view)} bytes at offset {offset}"
                )
            view, offset = view[written:], offset + written

    # ------------------------------------------------------------------ reads
    def read_file(self, path: Path, dst: np.ndarray, spare: int = 0) -> int:
        """Fill ``dst`` (uint8) from the start of ``path``; return the CRC of what was read.

        ``spare`` is how many writable bytes follow ``dst`` in memory (e.g. the page padding of
        an :func:`~tierswap.io._buffers.aligned_empty` tensor): with enough of them an unaligned
        tail is read in place instead of through the bounce buffer.
        """
        fd = self._open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            crc = self._read_blocks(fd, path, dst, spare)
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return crc
        finally:
            os.close(fd)

    def _read_blocks(self, fd: int, path: Path, dst: np.ndarray, spare: int) -> int:
        crc = 0
        block = self._block_for(dst)
        for offset in range(0, dst.size, block):
            piece = dst[offset : offset + block]
            tail_spare = spare if offset + block >= dst.size else 0
            self._read_piece(fd, path, piece, offset, tail_spare)
            crc = crc_of(piece, crc)
        return crc

    def _read_piece(self, fd: int, path: Path, piece: np.ndarray, offset: int, spare: int) -> None:
        want = round_up(piece.size) if self.direct else piece.size
        aligned = _address(piece) % ALIGN == 0 and want - piece.size <= spare
        if not self.direct or aligned:
            target = np.frombuffer(_widen(piece, want), dtype=np.uint8)
            got = self._pread_all(fd, target, offset, piece.size)
        else:
            bounce = self._bounce(want)
            got = self._pread_all(fd, bounce, offset, piece.size)
            piece[:] = bounce[: piece.size]
        if got < piece.size:
            raise CorruptionError(
                f"chunk file {str(path)!r} is truncated: {offset + got} bytes where "
                f"{offset + piece.size} or more are needed"
            )

    @staticmethod
    def _pread_all(fd: int, data: np.ndarray, offset: int, need: int) -> int:
        view, done = data.data.cast("B"), 0
        while done < need:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    # ------------------------------------------------------------------ helpers
    def _open(self, path: Path, flags: int) -> int:
        direct = _O_DIRECT if self.direct else 0
        try:
            return os.open(path, flags | direct, 0o644)
        except FileNotFoundError as exc:
            raise CorruptionError(f"chunk file {str(path)!r} is missing") from exc

    def _block_for(self, data: np.ndarray) -> int:
        """Request size for ``data``: ``block_bytes``, or at most :data:`BOUNCE_BYTES` when
        O_DIRECT must copy it through the bounce buffer (so that buffer stays small)."""
        if self.direct and _address(data) % ALIGN:
            return min(self.config.block_bytes, BOUNCE_BYTES)
        return self.config.block_bytes

    def _bounce(self, nbytes: int) -> np.ndarray:
        """This thread's aligned bounce buffer, at least ``nbytes`` long.

        It grows on demand (at most to ``BOUNCE_BYTES`` plus a page), so threads that only
        ever bounce the unaligned tail of a tensor keep a page or two rather than a whole block.
        """
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            grown = max(nbytes, 2 * (0 if bounce is None else bounce.size))
            size = min(grown, self.config.block_bytes, BOUNCE_BYTES)
            bounce = np.frombuffer(mmap.mmap(-1, max(size, nbytes)), dtype=np.uint8)
            self._local.bounce = bounce
        return bounce[:nbytes]


def _widen(piece: np.ndarray, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` starting at ``piece`` (caller checked the memory exists)."""
    if nbytes == piece.size:
        return piece.data
    import ctypes

    return memoryview((ctypes.c_ubyte * nbytes).from_address(_address(piece))).cast("B")


def _probe_write(directory: Path) -> bool:
    path = directory / f".odirect-probe-{uuid.uuid4().hex}"
    buf = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
        try:
            os.pwritev(fd, [buf.data], 0)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return True


def _probe_read(path: Path) -> bool:
    """Read the first page of the file at ``path`` with O_DIRECT."""
    buf = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8)
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECT)
        try:
            os.preadv(fd, [buf.data], 0)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def gather(futures: list[Future[T]]) -> Future[list[T]]:
    """A future that completes when all ``futures`` have; it fails with the first failure.

    Results keep the order of ``futures``. Completion runs in the thread that finished last.
    """
    combined: Future[list[T]] = Future()
    if not futures:
        combined.set_result([])
        return combined
    remaining = [len(futures)]
    lock = threading.Lock()
    # The callbacks reference this private list, not the caller's: clearing it once all are
    # done breaks the futures -> callback -> list -> futures cycle, so finished requests (and the
    # buffers their callbacks reach) are freed by reference counting, not by a later gc pass.
    pending = list(futures)

    def _one_done(_future: Future[T]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        done = pending[:]
        pending.clear()
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result([f.result() for f in done])

    for future in futures:
        future.add_done_callback(_one_done)
    return combined
