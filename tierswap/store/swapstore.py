"""SwapStore: the NVMe tier on its own, a crash-safe zarr v3 group of tensors.

Data path: ``put`` splits a tensor into chunk files written in parallel by the I/O engine;
``get`` reads them back in parallel, checking each chunk's CRC32C. Durable stores stage new chunk
files and make them visible atomically at ``commit()`` (see :mod:`tierswap.store._journal`);
scratch stores (``durable=False``) replace chunk files in place and skip every fsync.

Region reads and writes (``get_region`` / ``put_region``) move an element range of a stored
tensor: only the chunks it covers are read or written, so a tensor larger than memory can be
streamed a slice at a time (see :mod:`tierswap.store._regions`).

The class keeps the public API and the whole-key operations; its parts live beside it: the
concurrency gate (:mod:`~tierswap.store._gate`), the in-memory index and its claims
(:mod:`~tierswap.store._index`), where new chunk files go (:mod:`~tierswap.store._staging`),
whole-tensor writes (:mod:`~tierswap.store._puts`), region I/O
(:mod:`~tierswap.store._regions`) and commits (:mod:`~tierswap.store._commit`).

A store may span several folders, one per drive (``SwapStore([A, B])``): the first is the home
(metadata, journal), and chunk files are striped over all of them in proportion to their
measured bandwidth (:mod:`~tierswap.store._placement`), each folder with its own I/O queue.

Thread safety: see :class:`SwapStore`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import torch

from tierswap.config import IOConfig, Size, parse_size
from tierswap.errors import (
    ConfigError,
    InvalidTensorError,
    NoCommitError,
    ReadOnlyError,
    StoreClosedError,
)
from tierswap.io import gather
from tierswap.keys import validate_key
from tierswap.store import _journal as journal
from tierswap.store._chunks import ChunkFiles, start_engines
from tierswap.store._commit import Committer, SyncPolicy, check_meta, fsync_dirs
from tierswap.store._folder import StoreFolder
from tierswap.store._gate import Gate
from tierswap.store._index import Entry, PutClaim, ReadClaim, StoreIndex
from tierswap.store._layout import ArrayInfo, ArrayMeta, chunk_bytes_for
from tierswap.store._members import store_paths
from tierswap.store._placement import Placement, folder_weights
from tierswap.store._puts import WholeWrites
from tierswap.store._recycle import SPARE, SparePool
from tierswap.store._regions import RegionIO, check_region
from tierswap.store._snapshot import Progress, SnapshotResult, take_snapshot
from tierswap.store._staging import ChunkTargets
from tierswap.store._tensors import as_cpu_contiguous, flat_bytes, prepare_out, spare_bytes

__all__ = ["StorePaths", "SwapStore"]

Mode = Literal["r", "a", "w"]
#: A store's folder, or its folders (one per drive, the home first).
StorePaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


class SwapStore:
    """A folder of tensors, one zarr v3 array each, with atomic commits.

    Parameters
    ----------
    path:
        The store folder (created for ``mode="a"`` and ``"w"``), or a list of folders, one per
        drive: the first (the *home*) holds the metadata and the journal, and chunk files are
        spread over all of them in proportion to their weights (``io.weights``, measured by
        ``tierswap bench --dir A --dir B --tune F``; equal without), each folder with its own
        I/O queue. The home alone opens the whole store later (it lists the others).
    mode:
        ``"a"`` read/write, creating the store if missing; ``"w"`` start empty (wipes an existing
        store); ``"r"`` read only (no lock: readers may open a store that a writer holds).
    durable:
        ``True``: ``commit()`` is atomic and a crash at any instant leaves the last commit.
        ``False``: scratch store, written in place without fsync; ``close()`` commits metadata.
    chunk_bytes:
        Largest chunk file (a multiple of 4 KiB). Small tensors use one page-rounded chunk.
    io:
        I/O engine settings (for each folder's engine) and folder weights; default
        ``IOConfig.default()`` (``$TIERSWAP_CONFIG`` if set).

    Notes
    -----
    Thread safety: every method may be called from any thread. One gate
    (:class:`~tierswap.store._gate.Gate`, with shared and exclusive sections) orders them:

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
        path: StorePaths,
        *,
        mode: Mode = "a",
        durable: bool = True,
        chunk_bytes: Size = "16MiB",
        io: IOConfig | None = None,
    ) -> None:
        if mode not in ("r", "a", "w"):
            raise ConfigError(f"mode={mode!r} must be 'r', 'a' or 'w'")
        self.paths = store_paths(path)
        self.path = self.paths[0]
        self.readonly = mode == "r"
        self.durable = durable
        self.chunk_bytes = parse_size(chunk_bytes, name="chunk_bytes")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of 4096")
        self.io_config = io or IOConfig.default()
        self._folder = StoreFolder(list(self.paths))
        self._gate = Gate(self._check_open)
        self._index = StoreIndex(self.path)
        self._closed = True
        self._open(mode)
        self._closed = False

    # ================================================================== opening
    def _open(self, mode: Mode) -> None:
        """Lock and recover the folders (writers), start their I/O engines, load the index."""
        if self.readonly:
            self._folder.check_readable()
        else:
            self._folder.open_writer(wipe=mode == "w", durable=self.durable, sync_dirs=fsync_dirs)
        self.paths = tuple(self._folder.roots)
        try:
            self._engines = start_engines(self.io_config, self._folder, writable=not self.readonly)
        except BaseException:
            self._folder.unlock()
            raise
        self._engine = self._engines[0]
        try:
            self._placement = Placement(folder_weights(self.paths, self.io_config.folder_weights))
            self._load_index()
        except BaseException:  # a store that cannot open keeps neither the lock nor threads
            for engine in self._engines:
                engine.close()
            self._folder.unlock()
            raise

    def _load_index(self) -> None:
        """Read the last commit, then assemble the parts that depend on how it was written."""
        loaded = self._folder.load(through_journal=self.readonly)
        self.generation, self.meta = loaded.generation, loaded.meta
        if self.readonly:  # a reader reports how the store was written
            self.durable = loaded.durable
        self._index = StoreIndex(self.paths)
        self._index.load(loaded.arrays, loaded.damaged)
        sync = SyncPolicy(self._folder, self._engines, durable=self.durable)
        self._chunks = ChunkFiles(self._engines, sync_each_chunk=sync.each_chunk)
        names = itertools.count()  # spare names, unique across the folders
        spares = None
        if not self.readonly:
            spares = [SparePool(f.internal / SPARE, names) for f in self._folder.folders]
        self._targets = ChunkTargets(self._folder, durable=self.durable, spares=spares)
        self._targets.fit_spares(self._index.spare_room())
        self._commits = Committer(self._folder, self._targets, sync, durable=self.durable)
        self._regions = RegionIO(
            self._gate, self._index, self._chunks, self._targets, durable=self.durable
        )
        self._puts = WholeWrites(
            self._gate, self._index, self._chunks, self._targets,
            durable=self.durable, paths=self.paths,
        )  # fmt: skip

    # ================================================================== guards
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {str(self.path)!r} is closed; open a new SwapStore")
        if self._commits.broken is not None:
            raise StoreClosedError(
                f"store {str(self.path)!r}: a commit failed after its commit point "
                f"({self._commits.broken}); close and reopen the store, which finishes that commit"
            )

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {str(self.path)!r} was opened with mode='r'; use 'a'")

    # ================================================================== writes
    def put(self, key: str, tensor: torch.Tensor, *, chunk_bytes: Size | None = None) -> None:
        """Store ``tensor`` (any dtype, shape, device) under ``key``; visible to reads at once,
        durable after the next :meth:`commit`. ``chunk_bytes`` sets this array's largest
        chunk (a multiple of 4 KiB) instead of the store's."""
        self.put_async(key, tensor, chunk_bytes=chunk_bytes).result()

    def put_async(
        self, key: str, tensor: torch.Tensor, *, chunk_bytes: Size | None = None
    ) -> Future[None]:
        """Start storing ``tensor``; do not modify it until the returned future is done."""
        self._check_writable()
        validate_key(key)
        source = as_cpu_contiguous(tensor)
        chunk = _chunk_override(chunk_bytes)
        return self._start_put(key, source.dtype, tuple(source.shape), source, chunk)

    def put_many(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_bytes: Mapping[str, Size] | None = None,
    ) -> None:
        """Store every tensor of ``tensors`` (key -> tensor), all or none.

        The writes run in parallel; the keys change only once all of them succeeded, so when
        one fails (disk full, ...) no key changes and its error is raised. ``chunk_bytes``
        (key -> size) sets the largest chunk of the keys it names, as for :meth:`put`.
        """
        self._check_writable()
        sources = {validate_key(k): as_cpu_contiguous(t) for k, t in tensors.items()}
        chunks = {k: _chunk_override(v) for k, v in (chunk_bytes or {}).items()}
        metas = {
            key: self._new_meta(key, t.dtype, tuple(t.shape), chunks.get(key))
            for key, t in sources.items()
        }
        claim = PutClaim(self._index, list(sources), wait_reads=not self.durable)
        with self._gate.shared(claim):
            writes = [self._puts.submit(metas[key], source) for key, source in sources.items()]
            self._puts.install_all(writes)

    def create(
        self,
        key: str,
        shape: Iterable[int],
        dtype: torch.dtype,
        *,
        chunk_bytes: Size | None = None,
    ) -> None:
        """Store a tensor of zeros under ``key`` without writing its bytes.

        The chunk files are allocated sparsely, so this costs metadata, not a write of the whole
        tensor: the way to make an array larger than memory, to be filled by :meth:`put_region`.
        ``chunk_bytes`` sets this array's largest chunk (a multiple of 4 KiB) instead of the
        store's: e.g. so that a small array's chunks cover as much of a tensor as a large one's.
        """
        self._check_writable()
        validate_key(key)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or not isinstance(dtype, torch.dtype):
            raise InvalidTensorError(
                f"create({key!r}): shape {shape} and dtype {dtype!r} are invalid"
            )
        as_cpu_contiguous(torch.empty(0, dtype=dtype))  # raises for dtypes that cannot be stored
        self._start_put(key, dtype, shape, None, _chunk_override(chunk_bytes)).result()

    def _start_put(
        self,
        key: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        source: torch.Tensor | None,
        chunk_bytes: int | None = None,
    ) -> Future[None]:
        """Start a whole-tensor write (``source=None``: zeros) in a shared section that ends
        once the files are installed, or deleted after a failure."""
        meta = self._new_meta(key, dtype, shape, chunk_bytes)
        claim = PutClaim(self._index, [key], wait_reads=not self.durable)
        with self._gate.shared(claim) as section:
            return section.finish(self._puts.submit(meta, source), self._puts.install_written)

    def _new_meta(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], chunk_bytes: int | None = None
    ) -> ArrayMeta:
        nbytes = math.prod(shape) * dtype.itemsize
        largest = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        chunk = chunk_bytes_for(nbytes, largest, dtype.itemsize)
        folders = self._placement.folders(key, -(-nbytes // chunk))
        return ArrayMeta(key, dtype, shape, chunk, folders=folders)

    def delete(self, key: str) -> None:
        """Remove ``key``; the removal is durable after the next :meth:`commit`."""
        self._check_writable()
        validate_key(key)
        with self._gate.locked(busy=lambda: self._index.key_busy(key, False)):
            entry = self._index.delete(key)
            doomed = self._index.retire(entry) if entry is not None else []
        self._targets.discard(doomed)

    # ================================================================== reads
    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under ``key`` as a CPU tensor (``out`` filled when given)."""
        return self.get_async(key, out).result()

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading ``key`` into ``out`` (or a new page-aligned tensor)."""
        self._check_open()
        validate_key(key)
        claim = ReadClaim(self._index, key, self._targets.discard)
        with self._gate.shared(claim) as section:
            out = prepare_out(claim.entry.meta, out)
            return section.finish_with(self._submit_get(claim.entry, out), out)

    def _submit_get(self, entry: Entry, out: torch.Tensor) -> Future[list[None]]:
        flat, spare, meta, chunks = flat_bytes(out), spare_bytes(out), entry.meta, self._chunks
        futures = []
        for i in range(meta.nchunks):
            offset, length = meta.payload(i)
            tail = spare if i == meta.nchunks - 1 else 0
            piece = flat[offset : offset + length]
            chunk = entry.ref(i)
            futures.append(chunks.submit(chunk.folder, chunks.read, chunk, piece, tail))
        return gather(futures)

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
        return self._regions.read(key, start, stop, out)

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
        return self._regions.write(key, start, tensor)

    # ================================================================== savepoint
    def savepoint(self) -> None:
        """Keep every chunk's current version, so that :meth:`rollback` can return regions
        to it, until :meth:`release_savepoint` or the next :meth:`commit` (which ends it).
        A durable store only: a scratch store writes in place and keeps no versions.

        The kept versions are files the store would otherwise recycle: while a savepoint is
        set, each chunk rewritten since takes one more chunk file on disk. Setting a
        savepoint again first releases the previous one."""
        self._check_writable()
        if not self.durable:
            raise ConfigError("a scratch store (durable=False) writes in place: no savepoint")
        with self._gate.exclusive():
            self._check_writable()
            doomed = self._index.release_savepoint()
            self._index.saving = True
        self._targets.discard(doomed)

    def rollback(self, key: str, start: int = 0, stop: int | None = None) -> None:
        """Return the chunks holding elements ``[start, stop)`` of ``key`` (its end when
        ``stop`` is ``None``) to their versions at the savepoint: whole chunks, so elements
        of those chunks outside the region go back too. Waits for the operations in flight.
        Raises :class:`~tierswap.errors.SavepointError` when no savepoint is set or ``key``
        was put or deleted since."""
        self._check_writable()
        validate_key(key)
        with self._gate.exclusive():
            self._check_writable()
            self._index.check_savepoint(key)
            entry = self._index.lookup(key)
            span = check_region(entry.meta, start, entry.meta.numel if stop is None else stop)
            doomed = self._index.rollback(key, span)
        self._targets.discard(doomed)

    def release_savepoint(self) -> None:
        """Forget the savepoint's versions (their files become spares); a no-op without one."""
        self._check_writable()
        with self._gate.exclusive():
            doomed = self._index.release_savepoint()
        self._targets.discard(doomed)

    # ================================================================== queries
    def keys(self) -> list[str]:
        """Every key currently visible (committed or not), sorted."""
        self._check_open()
        with self._gate.locked():
            return self._index.keys()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored, damaged or being put (like :meth:`keys`)."""
        with self._gate.locked():
            return key in self._index

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def info(self, key: str) -> ArrayInfo:
        """dtype, shape and sizes of ``key`` without reading its data."""
        self._check_open()
        validate_key(key)
        with self._gate.locked(busy=lambda: self._index.key_busy(key, False)):
            return self._index.lookup(key).meta.info()

    @property
    def direct(self) -> bool:
        """True when the data path uses O_DIRECT (in every folder)."""
        return all(engine.direct for engine in self._engines)

    def stats(self) -> dict[str, int]:
        """Bytes and chunk files read and written through this store object."""
        return self._chunks.stats()

    def disk_usage(self) -> int:
        """Bytes the store's files occupy on disk (allocated blocks), in all its folders."""
        return self._folder.disk_usage()

    def folder_usage(self) -> dict[str, int]:
        """Bytes the store's files occupy in each of its folders (home first)."""
        return {str(root): self._folder.disk_usage(i) for i, root in enumerate(self.paths)}

    # ================================================================== commit
    def commit(self, meta: dict[str, Any] | None = None) -> int:
        """Make every put and delete so far durable, atomically; return the new generation.

        ``meta`` (JSON-serialisable, e.g. ``{"step": 100}``) is stored with the commit and read
        back as :attr:`meta`. Waits for operations in flight and holds new ones until done.
        """
        self._check_writable()
        meta = dict(self.meta if meta is None else meta)
        check_meta(meta)
        with self._gate.exclusive():
            self._check_writable()  # closed, or broken, while this call waited
            return self._commit_alone(meta)

    def _commit_alone(self, meta: dict[str, Any]) -> int:
        """The commit itself; the caller holds the gate exclusively."""
        generation = self.generation + 1
        self._targets.discard(self._index.release_savepoint())  # the commit ends it
        self._commits.commit(self._index, generation, meta)
        self.generation, self.meta = generation, meta
        return generation

    # ================================================================== integrity
    def verify(self) -> list[str]:
        """Check every chunk's CRC32C and every metadata document; list what is damaged."""
        self._check_open()
        with self._gate.locked():
            damaged, keys = self._index.damaged(), self._index.stored()
        problems = [f"key {key!r}: {why}" for key, why in damaged]
        for key in keys:
            problems += self._verify_key(key)
        return problems

    def _verify_key(self, key: str) -> list[str]:
        claim = ReadClaim(self._index, key, self._targets.discard, wait=False)
        with self._gate.shared(claim):
            if not claim.found:  # deleted meanwhile
                return []
            entry, meta, chunks = claim.entry, claim.entry.meta, self._chunks
            refs = [entry.ref(i) for i in range(meta.nchunks)]
            futures = [chunks.submit(ref.folder, chunks.verify, meta, ref) for ref in refs]
            return [problem for f in futures if (problem := f.result())]

    # ================================================================== snapshots
    def snapshot(
        self, dest: StorePaths, *, progress: bool | Progress | None = None
    ) -> SnapshotResult:
        """Keep the last commit as a standalone store in the new or empty folder ``dest``.

        Chunk files are hard links on the same filesystem (no data copied) and copies
        elsewhere (see :mod:`tierswap.store._snapshot`); uncommitted puts are not part of it.
        Commits, reads and writes wait while the files are listed and linked (not while they
        are copied). Neither store changes the other afterwards.

        A store on several folders makes a snapshot on as many: ``dest`` is a list of as many
        new or empty folders (one per drive, so that every chunk is linked), or one folder,
        which then holds the other folders inside its private folder (chunks from other
        drives are copied). Either opens as ``SwapStore(dest)`` (``dest[0]`` for a list).
        """
        self._check_open()
        hold = None if self.readonly else self._commits_held
        return take_snapshot(list(self.paths), dest, hold=hold, progress=progress)

    @contextlib.contextmanager
    def _commits_held(self) -> Iterator[None]:
        """The commit gate, held: the committed files stay where they are inside the block."""
        with self._gate.exclusive():
            self._check_open()
            if not self.durable and self._index.changed():
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
        with self._gate.exclusive():
            if self._closed:  # another thread closed it while this one waited
                return
            try:
                if not self.readonly and not self.durable and self._commits.broken is None:
                    self._commit_alone(dict(self.meta))
            finally:
                self._closed = True
                for engine in self._engines:
                    engine.close()
                # A journal left by a commit that failed after its commit point names staged
                # files: they stay for the next writer, which rolls that commit forward.
                if not self.readonly and not (self._folder.internal / journal.JOURNAL).exists():
                    for folder in self._folder.folders:
                        shutil.rmtree(folder.staging, ignore_errors=True)
                self._targets.clear()
                self._folder.unlock()

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "durable" if self.durable else "scratch"
        state = (
            "closed" if self._closed else f"{len(self._index)} keys, generation {self.generation}"
        )
        where = str(self.path) if len(self.paths) == 1 else [str(p) for p in self.paths]
        return f"SwapStore({where!r}, {kind}, {state})"


def _chunk_override(chunk_bytes: Size | None) -> int | None:
    """A per-array ``chunk_bytes``, checked as the store's is; ``None`` keeps the store's."""
    if chunk_bytes is None:
        return None
    chunk = parse_size(chunk_bytes, name="chunk_bytes")
    if chunk <= 0 or chunk % 4096:
        raise ConfigError(f"chunk_bytes={chunk} must be a positive multiple of 4096")
    return chunk
