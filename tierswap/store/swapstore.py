"""SwapStore: the NVMe tier on its own, a crash-safe zarr v3 group of tensors.

Data path: ``put`` splits a tensor into chunk files written in parallel by the I/O engine;
``get`` reads them back in parallel, checking each chunk's CRC32C. Durable stores stage new chunk
files and make them visible atomically at ``commit()`` (see :mod:`tierswap.store._journal`);
scratch stores (``durable=False``) replace chunk files in place and skip every fsync.

Region reads and writes (``get_region`` / ``put_region``) move an element range of a stored
tensor: only the chunks it covers are read or written, so a tensor larger than memory can be
streamed a slice at a time. A region write replaces whole chunk files (durable: new staged
files, committed like a put; scratch: overwritten in place), reading and re-checking a chunk
first only where the region covers it partly.

Thread safety: see :class:`SwapStore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch

from tierswap.config import IOConfig, Size, parse_size
from tierswap.errors import (
    ConfigError,
    CorruptionError,
    InvalidTensorError,
    KeyNotFoundError,
    NoCommitError,
    ReadOnlyError,
    RegionError,
    StoreClosedError,
)
from tierswap.io._engine import IOEngine, gather, translate_os_error
from tierswap.keys import KeyHierarchy, validate_key
from tierswap.store import _journal as journal
from tierswap.store._chunks import ChunkFiles, ChunkRef
from tierswap.store._folder import StoreFolder
from tierswap.store._layout import (
    ArrayInfo,
    ArrayMeta,
    chunk_bytes_for,
    chunk_relpath,
)
from tierswap.store._plan import plan_changes
from tierswap.store._recycle import SPARE, SparePool
from tierswap.store._snapshot import Progress, SnapshotResult, take_snapshot
from tierswap.store._tensors import as_cpu_contiguous, flat_bytes, prepare_out, spare_bytes

__all__ = ["SwapStore"]

Mode = Literal["r", "a", "w"]


@dataclasses.dataclass
class _Entry:
    """The current version of one key: its metadata and where its chunk files are."""

    meta: ArrayMeta
    files: list[Path]
    staged: set[int] = dataclasses.field(default_factory=set)  # chunks whose files are staged
    dirty: bool = False  # metadata differs from the last commit
    readers: int = 0
    retired: bool = False  # superseded; delete staged files when the last reader is done
    garbage: list[Path] = dataclasses.field(default_factory=list)  # replaced staged chunk files

    def unused_files(self) -> list[Path]:
        """Files no read uses any more, handed over (the caller recycles or deletes them):
        replaced staged versions, and every staged file once the entry is retired; none while
        a read of the entry is in flight. Called with the store's lock held."""
        if self.readers:
            return []
        doomed, self.garbage = self.garbage, []
        if self.retired:
            doomed += [self.files[i] for i in sorted(self.staged)]
            self.staged = set()
        return doomed


class SwapStore:
    """A folder of tensors, one zarr v3 array each, with atomic commits.

    Parameters
    ----------
    path:
        The store folder (created for ``mode="a"`` and ``"w"``).
    mode:
        ``"a"`` read/write, creating the store if missing; ``"w"`` start empty (wipes an existing
        store); ``"r"`` read only (no lock: readers may open a store that a writer holds).
    durable:
        ``True``: ``commit()`` is atomic and a crash at any instant leaves the last commit.
        ``False``: scratch store, written in place without fsync; ``close()`` commits metadata.
    chunk_bytes:
        Largest chunk file (a multiple of 4 KiB). Small tensors use one page-rounded chunk.
    io:
        I/O engine settings; default ``IOConfig.default()`` (``$TIERSWAP_CONFIG`` if set).

    Notes
    -----
    Thread safety: every method may be called from any thread. One gate, ``_cv`` with
    :meth:`_begin` (shared) and :meth:`_exclusive`, orders them:

    - puts, gets, region operations, ``delete`` and ``verify`` are *shared*: they run together;
    - ``commit()``, ``close()`` and the listing step of ``snapshot()`` are *exclusive*: each
      waits for the shared operations in flight, holds new ones back, and runs alone (two
      commits run one after the other; ``close()`` during a commit waits for it);
    - per key: a put waits for an earlier put or region write of the key; a get, ``info`` or
      region operation waits for the key's put in flight; a scratch store's put also waits for
      the key's reads (it renames over the files they read); region operations wait only for
      the writes (and a scratch store's in-place write for the reads) of the chunks they touch;
    - a key is in the store (``in``, :meth:`keys`) from the moment its first put starts; a put
      that fails removes it again.

    Anything an operation registers is undone when it fails, so a failed call leaves the store
    as it was (a scratch store's put that fails while renaming leaves its key damaged).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: Mode = "a",
        durable: bool = True,
        chunk_bytes: Size = "16MiB",
        io: IOConfig | None = None,
    ) -> None:
        if mode not in ("r", "a", "w"):
            raise ConfigError(f"mode={mode!r} must be 'r', 'a' or 'w'")
        self.path = Path(path).absolute()
        self.readonly = mode == "r"
        self.durable = durable
        self.chunk_bytes = parse_size(chunk_bytes, name="chunk_bytes")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of 4096")
        self.io_config = io or IOConfig.default()
        self._folder = StoreFolder(self.path)
        self._cv = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._names = KeyHierarchy()  # live keys (stored, damaged or being put) and groups
        self._committed: dict[str, ArrayMeta] = {}
        self._damaged: dict[str, str] = {}
        self._purged: set[str] = set()  # damaged keys deleted since the last commit
        self._pending: dict[str, Future[None]] = {}
        self._chunk_writes: set[tuple[str, int]] = set()  # chunks a region write is replacing
        self._chunk_reads: Counter[tuple[str, int]] = Counter()  # chunks region reads use
        self._region_writes: Counter[str] = Counter()  # region writes in flight per key
        self._active = 0
        self._committing = False  # an exclusive section (commit, close, snapshot) runs
        self._broken: str | None = None  # a commit failed after its commit point
        self._closed = True
        self._seq = itertools.count()
        self._open(mode)
        self._closed = False

    # ================================================================== opening
    def _open(self, mode: Mode) -> None:
        if self.readonly:
            self._folder.check_readable()
            self._engine = IOEngine(self.io_config, self.path, writable=False)
        else:
            self._folder.open_writer(
                wipe=mode == "w", durable=self.durable, sync_dirs=self._fsync_dirs
            )
            try:
                self._engine = IOEngine(self.io_config, self._folder.internal, writable=True)
            except BaseException:
                self._folder.unlock()
                raise
        self._chunks = ChunkFiles(self._engine, sync_each_chunk=self._sync_each_chunk)
        try:
            self._load_index()
        except BaseException:  # a store that cannot open keeps neither the lock nor threads
            self._engine.close()
            self._folder.unlock()
            raise

    def _load_index(self) -> None:
        index = self._folder.load(through_journal=self.readonly)
        self.generation, self.meta, self._damaged = index.generation, index.meta, index.damaged
        if self.readonly:  # a reader reports how the store was written
            self.durable = index.durable
        for key, (meta, files) in index.arrays.items():
            self._entries[key] = _Entry(meta, files)
            self._committed[key] = meta
        for key in [*index.arrays, *index.damaged]:
            self._names.add(key)
        self._spares = None if self.readonly else SparePool(self._folder.internal / SPARE)
        self._update_spare_cap()

    # ================================================================== guards
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {str(self.path)!r} is closed; open a new SwapStore")
        if self._broken is not None:
            raise StoreClosedError(
                f"store {str(self.path)!r}: a commit failed after its commit point "
                f"({self._broken}); close and reopen the store, which finishes that commit"
            )

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {str(self.path)!r} was opened with mode='r'; use 'a'")

    def _begin(self) -> None:
        """Count one operation in flight (caller holds ``_cv``); waits out a running commit."""
        while self._committing:
            self._cv.wait()
        self._check_open()
        self._active += 1

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Run the block alone: after the exclusive section before it and every shared
        operation in flight, with new ones held back until it ends."""
        with self._cv:
            while self._committing:
                self._cv.wait()
            self._committing = True
            while self._active:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._committing = False
                self._cv.notify_all()

    def _wait_key(self, key: str, *, readers: bool = False) -> None:
        """Wait (``_cv`` held) out a commit and ``key``'s put and region writes in flight
        (their failures are the writer's to report), and with ``readers`` its reads too."""
        self._wait_keys([key], readers=readers)

    def _wait_keys(self, keys: list[str], *, readers: bool = False) -> None:
        """:meth:`_wait_key` for several keys at once (none is claimed while waiting, so a
        commit never waits for a caller that waits for it)."""
        self._wait_until_free(lambda: any(self._key_busy(key, readers) for key in keys))

    def _wait_until_free(self, busy: Callable[[], bool]) -> None:
        """Wait (``_cv`` held) out a commit, then until ``busy()`` is false; every wait ends
        with the store checked open again (``busy`` may raise, e.g. for a deleted key)."""
        while True:
            while self._committing:
                self._cv.wait()
            self._check_open()
            if not busy():
                return
            self._cv.wait()

    def _key_busy(self, key: str, readers: bool) -> bool:
        entry = self._entries.get(key)
        busy = key in self._pending or self._region_writes[key] > 0
        return busy or (readers and entry is not None and entry.readers > 0)

    # ================================================================== writes
    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (any dtype, shape, device) under ``key``; visible to reads at once,
        durable after the next :meth:`commit`."""
        self.put_async(key, tensor).result()

    def put_async(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Start storing ``tensor``; do not modify it until the returned future is done."""
        self._check_writable()
        validate_key(key)
        source = as_cpu_contiguous(tensor)
        return self._start_put(key, source.dtype, tuple(source.shape), source)

    def put_many(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store every tensor of ``tensors`` (key -> tensor), all or none.

        The writes run in parallel; the keys change only once all of them succeeded, so when
        one fails (disk full, ...) no key changes and its error is raised.
        """
        self._check_writable()
        sources = {validate_key(k): as_cpu_contiguous(t) for k, t in tensors.items()}
        metas = {key: self._new_meta(key, t.dtype, tuple(t.shape)) for key, t in sources.items()}
        results: dict[str, Future[Any]] = {key: Future() for key in sources}
        with self._cv:
            self._wait_keys(list(sources), readers=not self.durable)
            added: list[str] = []
            try:
                for key in sources:
                    self._names.check(key)
                    self._names.add(key)
                    added.append(key)
            except BaseException:
                for key in added:
                    self._names.remove(key)
                raise
            self._pending.update(results)
            self._active += len(sources)
            seqs = {key: next(self._seq) for key in sources}
        for key, source in sources.items():
            self._submit_put(metas[key], source, seqs[key], results[key], install=False)
        self._install_all(results)

    def _install_all(self, results: dict[str, Future[Any]]) -> None:
        """Install the writes of :meth:`put_many` once all ended, or none; then unregister."""
        written, error = [], None
        for future in results.values():
            try:
                written.append(future.result())
            except BaseException as exc:
                error = error or exc
        try:
            if error is None:
                for meta, paths in written:
                    self._install(meta, paths)
        except OSError as exc:
            error = translate_os_error(exc, "installing the keys of put_many")
        finally:
            if error is not None:
                _unlink_all(path for _meta, paths in written for path in paths)
            for key, future in results.items():
                self._unregister_put(key, future)
        if error is not None:
            raise error

    def create(self, key: str, shape: Iterable[int], dtype: torch.dtype) -> None:
        """Store a tensor of zeros under ``key`` without writing its bytes.

        The chunk files are allocated sparsely, so this costs metadata, not a write of the whole
        tensor: the way to make an array larger than memory, to be filled by :meth:`put_region`.
        """
        self._check_writable()
        validate_key(key)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or not isinstance(dtype, torch.dtype):
            raise InvalidTensorError(
                f"create({key!r}): shape {shape} and dtype {dtype!r} are invalid"
            )
        as_cpu_contiguous(torch.empty(0, dtype=dtype))  # raises for dtypes that cannot be stored
        self._start_put(key, dtype, shape, None).result()

    def _start_put(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], source: torch.Tensor | None
    ) -> Future[None]:
        """Register and start a whole-tensor write (``source=None``: zeros).

        A scratch store's put renames over the files that reads of the key use: it waits for
        them. Registered here, undone by :meth:`_finish_put` whatever happens next.
        """
        meta = self._new_meta(key, dtype, shape)
        with self._cv:
            self._wait_key(key, readers=not self.durable)
            self._names.check(key)
            self._active += 1
            result: Future[None] = Future()
            self._pending[key] = result
            self._names.add(key)
            seq = next(self._seq)
        self._submit_put(meta, source, seq, result)
        return result

    def _new_meta(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> ArrayMeta:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk = chunk_bytes_for(nbytes, self.chunk_bytes, dtype.itemsize)
        return ArrayMeta(key, dtype, shape, chunk)

    def _submit_put(
        self,
        meta: ArrayMeta,
        source: torch.Tensor | None,
        seq: int,
        result: Future[Any],
        *,
        install: bool = True,
    ) -> None:
        paths: list[Path] = []
        futures: list[Future[int]] = []
        try:
            flat = flat_bytes(source) if source is not None else None
            for i in range(meta.nchunks):
                offset, length = meta.payload(i)
                if flat is None:
                    paths.append(self._new_chunk_path(meta.key, seq, i))
                    futures.append(
                        self._engine.submit(self._chunks.zero, paths[-1], length, meta.chunk_bytes)
                    )
                    continue
                path, recycled = self._write_target(meta, seq, i)
                paths.append(path)
                piece = flat[offset : offset + length]
                futures.append(
                    self._engine.submit(self._chunks.write, path, piece, meta.chunk_bytes, recycled)
                )
        except BaseException as exc:  # failed to start: undone once the started writes end
            failed: Future[int] = Future()
            failed.set_exception(exc)
            futures.append(failed)
        done = gather(futures)
        done.add_done_callback(
            lambda f: self._finish_put(meta, paths, source, f, result, install=install)
        )

    def _new_chunk_path(self, key: str, seq: int, index: int) -> Path:
        if self.durable:
            self._folder.staging.mkdir(exist_ok=True)
            return self._folder.staging / f"{seq}.{index}"
        final = self.path / chunk_relpath(key, index)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f"{index}.{seq}.partial")

    def _write_target(self, meta: ArrayMeta, seq: int, index: int) -> tuple[Path, bool]:
        """Where a durable write of chunk ``index`` goes: a staging file, recycled from a spare
        when one of the size is free (whole chunks only: a spare's bytes past a shorter
        payload would not be zeros); returns the path and whether it was recycled."""
        path = self._new_chunk_path(meta.key, seq, index)
        _offset, length = meta.payload(index)
        if self.durable and self._spares is not None and length == meta.chunk_bytes:
            return path, self._spares.take(meta.chunk_bytes, path)
        return path, False

    def _discard(self, paths: list[Path]) -> None:
        """Superseded staged files: kept as spares (durable stores), else deleted."""
        if self._spares is not None and self.durable:
            self._spares.keep(paths)
        else:
            _unlink_all(paths)

    def _update_spare_cap(self) -> None:
        """Spares may hold as many bytes as the committed chunks: disk use stays within 2x."""
        if self._spares is not None:
            self._spares.cap = sum(m.nchunks * m.chunk_bytes for m in self._committed.values())

    def _finish_put(
        self,
        meta: ArrayMeta,
        paths: list[Path],
        source: torch.Tensor | None,
        done: Future[list[int]],
        result: Future[Any],
        *,
        install: bool = True,
    ) -> None:
        """Install finished writes (or undo failed ones) and unregister the put; with
        ``install=False`` only report ``(meta, paths)``: the caller installs and unregisters."""
        del source  # kept alive until the writes finished
        error = done.exception()
        written = dataclasses.replace(meta, crcs=tuple(done.result())) if error is None else meta
        try:
            if error is None and install:
                self._install(written, paths)
        except OSError as exc:
            error = translate_os_error(exc, f"installing key {meta.key!r}")
        if error is not None:
            _unlink_all(paths)
        if not install:
            if error is None:
                result.set_result((written, paths))
            else:
                result.set_exception(error)
            return
        self._unregister_put(meta.key, result)
        if error is None:
            result.set_result(None)
        else:
            result.set_exception(error)

    def _unregister_put(self, key: str, result: Future[Any]) -> None:
        with self._cv:
            if self._pending.get(key) is result:
                del self._pending[key]
            self._names.remove(key)
            self._active -= 1
            self._cv.notify_all()

    def _install(self, meta: ArrayMeta, paths: list[Path]) -> None:
        """Make freshly written chunk files the current version of ``meta.key``."""
        if not self.durable:  # scratch: rename over the old chunks, drop any extra ones
            finals = [self.path / chunk_relpath(meta.key, i) for i in range(len(paths))]
            for i, (path, final) in enumerate(zip(paths, finals, strict=True)):
                try:
                    os.replace(path, final)
                except OSError as exc:
                    if i:  # old and new chunk files mixed: neither version is there
                        self._damage(meta.key, f"a put failed midway through its renames: {exc}")
                    raise
            old = self._entries.get(meta.key)
            for extra in old.files[len(finals) :] if old else []:
                with contextlib.suppress(FileNotFoundError):
                    extra.unlink()
            paths = finals
        with self._cv:
            old = self._entries.get(meta.key)
            staged = set(range(len(paths))) if self.durable else set()
            self._entries[meta.key] = _Entry(meta, paths, staged=staged, dirty=True)
            if old is None and self._damaged.pop(meta.key, None) is None:
                self._names.add(meta.key)  # (a damaged key already counts as live)
        if old is not None:
            self._retire(old)

    def _damage(self, key: str, why: str) -> None:
        """Report ``key`` as damaged (a scratch store's in-place change failed midway): reads
        raise, :meth:`verify` lists it, a put or delete repairs it. Its files stay as they
        are until then (the next commit leaves them alone, so a reopen finds the damage)."""
        with self._cv:
            entry = self._entries.pop(key, None)
            self._committed.pop(key, None)
            self._damaged[key] = f"{why}; put the key again or delete it"
        if entry is not None:
            self._retire(entry)

    def _retire(self, entry: _Entry) -> None:
        """Delete a superseded entry's staged files once no read uses them."""
        with self._cv:
            entry.retired = True
            doomed = entry.unused_files()
        self._discard(doomed)

    def delete(self, key: str) -> None:
        """Remove ``key``; the removal is durable after the next :meth:`commit`."""
        self._check_writable()
        validate_key(key)
        with self._cv:
            self._wait_key(key)
            entry = self._entries.pop(key, None)
            damaged = self._damaged.pop(key, None)
            if entry is None and damaged is None:
                raise KeyNotFoundError(f"key {key!r} is not in store {str(self.path)!r}")
            self._names.remove(key)
            if damaged is not None:
                self._purged.add(key)
        if entry is not None:
            self._retire(entry)

    # ================================================================== reads
    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under ``key`` as a CPU tensor (``out`` filled when given)."""
        return self.get_async(key, out).result()

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading ``key`` into ``out`` (or a new page-aligned tensor)."""
        self._check_open()
        validate_key(key)
        with self._cv:
            self._wait_key(key)
            entry = self._lookup(key)
            self._active += 1
            entry.readers += 1
        try:
            out = prepare_out(entry.meta, out)
            reads = self._submit_get(entry, out)
        except BaseException:
            self._release(entry)
            raise
        return self._read_result(reads, entry, (), out)

    def _read_result(
        self,
        reads: Future[list[None]],
        entry: _Entry,
        chunks: Iterable[tuple[str, int]],
        out: torch.Tensor,
    ) -> Future[torch.Tensor]:
        """The caller's future of a read: ``out`` once ``reads`` end (the entry released)."""
        result: Future[torch.Tensor] = Future()

        def _done(finished: Future[list[None]]) -> None:
            self._release(entry, chunks)
            error = finished.exception()
            if error is None:
                result.set_result(out)
            else:
                result.set_exception(error)

        reads.add_done_callback(_done)
        return result

    def _lookup(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if key in self._damaged:
            raise CorruptionError(f"key {key!r}: {self._damaged[key]}")
        raise KeyNotFoundError(f"key {key!r} is not in store {str(self.path)!r}")

    def _submit_get(self, entry: _Entry, out: torch.Tensor) -> Future[list[None]]:
        flat, spare, meta = flat_bytes(out), spare_bytes(out), entry.meta
        futures = []
        for i in range(meta.nchunks):
            offset, length = meta.payload(i)
            tail = spare if i == meta.nchunks - 1 else 0
            piece = flat[offset : offset + length]
            chunk = ChunkRef(meta.key, i, entry.files[i], meta.crcs[i])
            futures.append(self._engine.submit(self._chunks.read, chunk, piece, tail))
        return gather(futures)

    def _release(self, entry: _Entry, chunks: Iterable[tuple[str, int]] = ()) -> None:
        with self._cv:
            entry.readers -= 1
            self._chunk_reads.subtract(chunks)
            doomed = entry.unused_files()
            self._active -= 1
            self._cv.notify_all()
        self._discard(doomed)

    # ================================================================== regions
    def get_region(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor under ``key``, as a 1-D CPU tensor.

        Only the chunks holding the range are read; each is checked whole against its CRC32C.
        """
        return self.get_region_async(key, start, stop, out).result()

    def get_region_async(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> Future[torch.Tensor]:
        """Start reading elements ``[start, stop)`` of ``key`` into ``out`` (or a new tensor)."""
        self._check_open()
        validate_key(key)
        entry, span = self._claim_region(key, start, stop, write=False)
        chunks = [(key, i) for i in span]
        try:
            out = prepare_out(entry.meta, out, region=stop - start)
            refs = [ChunkRef(key, i, entry.files[i], entry.meta.crcs[i]) for i in span]
            reads = gather(
                [
                    self._engine.submit(self._chunks.read_region, entry.meta, ref, start, out)
                    for ref in refs
                ]
            )
        except BaseException:
            self._release(entry, chunks)
            raise
        return self._read_result(reads, entry, chunks, out)

    def put_region(self, key: str, start: int, tensor: torch.Tensor) -> None:
        """Overwrite elements ``[start, start + tensor.numel())`` of ``key`` with ``tensor``'s
        (same dtype, any shape); visible to reads at once, durable after the next commit."""
        self.put_region_async(key, start, tensor).result()

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        """Start a region write; do not modify ``tensor`` until the returned future is done.

        A failed write leaves the key as it was (durable stores); a scratch store's in-place
        write that fails midway leaves the chunk failing its checksum, never silently wrong.
        """
        self._check_writable()
        validate_key(key)
        source = as_cpu_contiguous(tensor).reshape(-1)
        stop = start + source.numel() if isinstance(start, int) else start
        entry, span = self._claim_region(key, start, stop, write=True, dtype=source.dtype)
        seq = next(self._seq)
        news: list[Path] = []
        try:
            futures = []
            for i in span:
                new, recycled = (
                    self._write_target(entry.meta, seq, i)
                    if self.durable
                    else (entry.files[i], True)  # scratch: in place
                )
                news.append(new)
                ref = ChunkRef(key, i, entry.files[i], entry.meta.crcs[i])
                futures.append(
                    self._engine.submit(
                        self._chunks.write_region, entry.meta, ref, (new, recycled), start, source
                    )
                )
            done = gather(futures)
        except BaseException:
            self._finish_region(entry, span, news, None)
            raise
        result: Future[None] = Future()

        def _done(finished: Future[list[int]]) -> None:
            error = self._finish_region(entry, span, news, finished)
            if error is None:
                result.set_result(None)
            else:
                result.set_exception(error)

        done.add_done_callback(_done)
        return result

    def _claim_region(
        self,
        key: str,
        start: int,
        stop: int,
        *,
        write: bool,
        dtype: torch.dtype | None = None,
    ) -> tuple[_Entry, range]:
        """Check the region and register the operation once no write (and, for an in-place
        write, no read) holds its chunks; returns the entry and the chunk indices."""
        with self._cv:

            def busy() -> bool:
                span = _check_region(self._lookup(key).meta, start, stop, dtype)
                chunks = [(key, i) for i in span]
                if key in self._pending or any(c in self._chunk_writes for c in chunks):
                    return True
                return write and not self.durable and any(self._chunk_reads[c] for c in chunks)

            self._wait_until_free(busy)
            entry = self._lookup(key)
            span = _check_region(entry.meta, start, stop, dtype)
            chunks = [(key, i) for i in span]
            self._active += 1
            if write:
                self._chunk_writes.update(chunks)
                self._region_writes[key] += 1
            else:
                entry.readers += 1
                self._chunk_reads.update(chunks)
            return entry, span

    def _finish_region(
        self,
        entry: _Entry,
        span: range,
        news: list[Path],
        done: Future[list[int]] | None,
    ) -> BaseException | None:
        """Install a finished region write (or undo a failed one); returns its error."""
        error = done.exception() if done is not None else None
        if done is not None and error is None:
            crcs = list(entry.meta.crcs)
            with self._cv:
                for i, new, crc in zip(span, news, done.result(), strict=True):
                    crcs[i] = crc
                    if self.durable:
                        if i in entry.staged:
                            entry.garbage.append(entry.files[i])
                        entry.files[i] = new
                        entry.staged.add(i)
                entry.meta = dataclasses.replace(entry.meta, crcs=tuple(crcs))
                entry.dirty = True
        elif self.durable:
            _unlink_all(news)
        with self._cv:
            self._chunk_writes.difference_update((entry.meta.key, i) for i in span)
            self._region_writes[entry.meta.key] -= 1
            doomed = entry.unused_files()
            self._active -= 1
            self._cv.notify_all()
        self._discard(doomed)
        return error

    # ================================================================== queries
    def keys(self) -> list[str]:
        """Every key currently visible (committed or not), sorted."""
        self._check_open()
        with self._cv:
            return sorted(self._entries.keys() | self._damaged.keys() | self._pending.keys())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored, damaged or being put (like :meth:`keys`)."""
        with self._cv:
            return key in self._entries or key in self._damaged or key in self._pending

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def info(self, key: str) -> ArrayInfo:
        """dtype, shape and sizes of ``key`` without reading its data."""
        self._check_open()
        validate_key(key)
        with self._cv:
            self._wait_key(key)
            return self._lookup(key).meta.info()

    @property
    def direct(self) -> bool:
        """True when the data path uses O_DIRECT."""
        return self._engine.direct

    def stats(self) -> dict[str, int]:
        """Bytes and chunk files read and written through this store object."""
        return self._chunks.stats()

    def disk_usage(self) -> int:
        """Bytes the store's files occupy on disk (allocated blocks)."""
        return self._folder.disk_usage()

    # ================================================================== commit
    def commit(self, meta: dict[str, Any] | None = None) -> int:
        """Make every put and delete so far durable, atomically; return the new generation.

        ``meta`` (JSON-serialisable, e.g. ``{"step": 100}``) is stored with the commit and read
        back as :attr:`meta`. Waits for operations in flight and holds new ones until done.
        """
        self._check_writable()
        meta = dict(self.meta if meta is None else meta)
        _check_json(meta)
        with self._exclusive():
            self._check_writable()  # closed, or broken, while this call waited
            return self._commit_alone(meta)

    def _commit_alone(self, meta: dict[str, Any]) -> int:
        """The commit itself; the caller holds the gate exclusively."""
        generation = self.generation + 1
        current = {key: entry.meta for key, entry in self._entries.items()}
        changed = {
            key: [
                str(p.relative_to(self.path)) if i in entry.staged else None
                for i, p in enumerate(entry.files)
            ]
            for key, entry in self._entries.items()
            if entry.dirty
        }
        changes = plan_changes(
            self._committed,
            current,
            changed,
            generation=generation,
            meta=meta,
            durable=self.durable,
            purged={key: self._folder.files_of(key) for key in self._purged},
        )
        recycle = self._recycle_plan(changes.chunk_moves)
        plan = journal.CommitPlan(
            generation,
            tuple(changes.chunk_moves),
            tuple(changes.unlinks),
            tuple(changes.rmdirs),
            tuple((final, str(spare.relative_to(self.path))) for final, spare in recycle),
        )
        documents = [(rel, json.dumps(doc).encode()) for rel, doc in changes.documents]
        try:
            if self.durable:
                journal.commit_durable(
                    self.path,
                    self._folder.staging,
                    plan,
                    documents,
                    sync_files=self._sync_files,
                    sync_dirs=self._fsync_dirs,
                )
            else:
                journal.apply_in_place(self.path, plan, documents)
        except BaseException as exc:
            if self.durable and (self._folder.internal / journal.JOURNAL).exists():
                # Past the commit point: the journal is the truth, this object's view is not.
                self._broken = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OSError):
                raise translate_os_error(exc, f"committing store {str(self.path)!r}") from exc
            raise
        if self._spares is not None:
            self._spares.adopt(spare for _final, spare in recycle)
        for key, entry in self._entries.items():
            if entry.dirty:
                rels = [chunk_relpath(key, i) for i in range(entry.meta.nchunks)]
                entry.files = [self.path / r for r in rels]
                entry.staged, entry.dirty = set(), False
        self._committed, self.generation, self.meta = current, generation, meta
        self._purged.clear()
        self._update_spare_cap()
        return generation

    def _recycle_plan(self, moves: list[tuple[str, str]]) -> list[tuple[str, Path]]:
        """(final relpath, spare path) for each committed whole chunk a staged one replaces."""
        if self._spares is None or not self.durable:
            return []
        recycle = []
        for _src, final in moves:
            head, _, index = final.rpartition("/")  # final is chunk_relpath(key, index)
            old = self._committed.get(head.removesuffix("/c"))
            if old is None or not index.isdigit() or int(index) >= old.nchunks:
                continue
            if old.payload(int(index))[1] == old.chunk_bytes:
                recycle.append((final, self._spares.new_path()))
        return recycle

    def _run_parallel(self, fn: Callable[..., object], calls: list[tuple[Any, ...]]) -> None:
        """Run ``fn(*args)`` for every args tuple, on the I/O pool once it exists."""
        engine = getattr(self, "_engine", None)
        if engine is None:  # during recovery, before the pool exists
            for args in calls:
                fn(*args)
            return
        gather([engine.submit(fn, *args) for args in calls]).result()

    @property
    def _sync_each_chunk(self) -> bool:
        """Whether each chunk file is fdatasync'ed as it is written.

        With O_DIRECT the bytes are already on the device; only their metadata (and the drive's
        cache) needs flushing, so a durable store defers that to one ``syncfs`` per commit phase
        where the platform has it. Buffered writes are synced per file, so that the pages can be
        dropped from the page cache at once.
        """
        return self.durable and not (self._engine.direct and journal.HAVE_SYNCFS)

    def _sync_files(self, paths: list[Path]) -> None:
        if self._sync_each_chunk:
            self._run_parallel(journal.fdatasync_path, [(path,) for path in paths])
        else:  # one flush makes the unsynced chunks and the staged documents durable
            journal.syncfs(self.path)

    def _fsync_dirs(self, dirs: Iterable[Path]) -> None:
        if getattr(self, "_engine", None) is not None and not self._sync_each_chunk:
            journal.syncfs(self.path)
            return
        self._run_parallel(journal.fsync_dir, [(path,) for path in dirs])

    # ================================================================== integrity
    def verify(self) -> list[str]:
        """Check every chunk's CRC32C and every metadata document; list what is damaged."""
        self._check_open()
        with self._cv:
            damaged, keys = sorted(self._damaged.items()), sorted(self._entries)
        problems = [f"key {key!r}: {why}" for key, why in damaged]
        for key in keys:
            problems += self._verify_key(key)
        return problems

    def _verify_key(self, key: str) -> list[str]:
        with self._cv:
            entry = self._entries.get(key)
            if entry is None:
                return []
            self._begin()
            entry.readers += 1
        try:
            meta = entry.meta
            refs = [ChunkRef(key, i, entry.files[i], meta.crcs[i]) for i in range(meta.nchunks)]
            futures = [self._engine.submit(self._chunks.verify, meta, ref) for ref in refs]
            return [problem for f in futures if (problem := f.result())]
        finally:
            self._release(entry)

    # ================================================================== snapshots
    def snapshot(
        self, dest: str | os.PathLike[str], *, progress: bool | Progress | None = None
    ) -> SnapshotResult:
        """Keep the last commit as a standalone store in the new or empty folder ``dest``.

        Chunk files are hard links on the same filesystem (no data copied) and copies
        elsewhere (see :mod:`tierswap.store._snapshot`); uncommitted puts are not part of it.
        Commits, reads and writes wait while the files are listed and linked (not while they
        are copied). Neither store changes the other afterwards.
        """
        self._check_open()
        hold = None if self.readonly else self._commits_held
        return take_snapshot(self.path, dest, hold=hold, progress=progress)

    @contextlib.contextmanager
    def _commits_held(self) -> Iterator[None]:
        """The commit gate, held: the committed files stay where they are inside the block."""
        with self._exclusive():
            self._check_open()
            if not self.durable and (self._purged or any(e.dirty for e in self._entries.values())):
                raise NoCommitError(
                    f"scratch store {str(self.path)!r} changed since its last commit and wrote "
                    "over it in place; call commit() before taking a snapshot"
                )
            yield

    # ================================================================== lifetime
    def close(self) -> None:
        """Wait for operations in flight, release the lock. Uncommitted durable changes are
        discarded; a scratch store commits its metadata first."""
        if self._closed:
            return
        with self._exclusive():
            if self._closed:  # another thread closed it while this one waited
                return
            try:
                if not self.readonly and not self.durable and self._broken is None:
                    self._commit_alone(dict(self.meta))
            finally:
                self._closed = True
                self._engine.close()
                # A journal left by a commit that failed after its commit point names staged
                # files: they stay for the next writer, which rolls that commit forward.
                if not self.readonly and not (self._folder.internal / journal.JOURNAL).exists():
                    shutil.rmtree(self._folder.staging, ignore_errors=True)
                if self._spares is not None:
                    self._spares.clear()
                self._folder.unlock()

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "durable" if self.durable else "scratch"
        state = (
            "closed" if self._closed else f"{len(self._entries)} keys, generation {self.generation}"
        )
        return f"SwapStore({str(self.path)!r}, {kind}, {state})"


def _check_region(
    meta: ArrayMeta, start: int, stop: int, dtype: torch.dtype | None = None
) -> range:
    """The chunk indices of elements ``[start, stop)``; raises for a bad region or dtype."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
    if not ints or not 0 <= start <= stop <= meta.numel:
        raise RegionError(
            f"region [{start!r}, {stop!r}) of key {meta.key!r} is not within its {meta.numel} "
            f"elements; pass ints with 0 <= start <= stop <= {meta.numel}"
        )
    if dtype is not None and dtype != meta.dtype:
        raise InvalidTensorError(
            f"key {meta.key!r} holds {meta.dtype}, not {dtype}; convert the tensor first"
        )
    return meta.chunk_span(start, stop)


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _check_json(meta: dict[str, Any]) -> None:
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"commit meta {meta!r} is not JSON-serialisable: {exc}") from exc
