"""What a store holds in memory: its entries, its last commit, and the operations claiming them.

:class:`StoreIndex` is the live view of one store: the current version of every key (its
metadata and chunk files), the damaged keys, the metadata of the last commit, and what the
operations in flight have registered (puts per key, region writes per chunk, reads per entry).
The claims here (:class:`PutClaim`, :class:`ReadClaim`) are what the store's
:class:`~tierswap.store._gate.Gate` takes and gives back around an operation.

Thread safety: none of its own. Every method runs with the store's gate lock held (inside
``Gate.locked()`` or a claim's methods); the gate is the store's only lock.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from tierswap.errors import CorruptionError, KeyNotFoundError, SavepointError
from tierswap.keys import KeyHierarchy
from tierswap.store._chunks import ChunkRef
from tierswap.store._layout import ArrayMeta, locate, qualify

__all__ = ["Chunk", "Entry", "PutClaim", "ReadClaim", "StoreIndex"]

#: A chunk of a key: ``(key, chunk index)``.
Chunk = tuple[str, int]
#: What a claim does with files no read uses any more (recycle or delete them).
Discard = Callable[[list[Path]], None]


@dataclasses.dataclass
class Entry:
    """The current version of one key: its metadata and where its chunk files are."""

    meta: ArrayMeta
    files: list[Path]
    staged: set[int] = dataclasses.field(default_factory=set)  # chunks whose files are staged
    dirty: bool = False  # metadata differs from the last commit
    readers: int = 0
    retired: bool = False  # superseded; delete staged files when the last reader is done
    garbage: list[Path] = dataclasses.field(default_factory=list)  # replaced staged chunk files
    #: Chunks rewritten since the store's savepoint -> their file, CRC and whether that file
    #: was staged, at the savepoint (:meth:`StoreIndex.rollback` returns them there).
    saved: dict[int, tuple[Path, int, bool]] = dataclasses.field(default_factory=dict)

    def ref(self, index: int) -> ChunkRef:
        """Chunk ``index``: its file, checksum and folder (read with the gate lock held)."""
        meta = self.meta
        return ChunkRef(meta.key, index, self.files[index], meta.crcs[index], meta.folder_of(index))

    def unused_files(self) -> list[Path]:
        """Files no read uses any more, handed over (the caller recycles or deletes them):
        replaced staged versions, and every staged file once the entry is retired; none while
        a read of the entry is in flight."""
        if self.readers:
            return []
        doomed, self.garbage = self.garbage, []
        if self.retired:
            doomed += [self.files[i] for i in sorted(self.staged)]
            doomed += [path for path, _crc, staged in self.saved.values() if staged]
            self.staged, self.saved = set(), {}
        return doomed

    def forget_saved(self) -> None:
        """The savepoint ends: its staged versions become garbage."""
        self.garbage += [path for path, _crc, staged in self.saved.values() if staged]
        self.saved = {}


class StoreIndex:
    """The keys of one store now, at its last commit, and in flight (lock held throughout)."""

    def __init__(self, root: Path | Sequence[Path]) -> None:
        self.roots = [root] if isinstance(root, Path) else list(root)
        self.root = self.roots[0]  # the home: named in messages
        self._entries: dict[str, Entry] = {}
        self._names = KeyHierarchy()  # live keys (stored, damaged or being put) and groups
        self._committed: dict[str, ArrayMeta] = {}
        self._damaged: dict[str, str] = {}
        self._purged: set[str] = set()  # damaged keys deleted since the last commit
        self._pending: dict[str, object] = {}  # key -> the claim of its put in flight
        self._chunk_writes: set[Chunk] = set()  # chunks a region write is replacing
        self._chunk_reads: Counter[Chunk] = Counter()  # chunks region reads use
        self._region_writes: Counter[str] = Counter()  # region writes in flight per key
        self.saving = False  # a savepoint is set: region writes keep the versions they replace
        self._replaced: set[str] = set()  # keys put or deleted since the savepoint
        self._bytes = [0] * len(self.roots)  # chunk bytes of the current entries per folder
        self._committed_bytes = [0] * len(self.roots)  # ... and of the last commit's

    # ------------------------------------------------------------------ loading, queries
    def load(
        self, arrays: Mapping[str, tuple[ArrayMeta, list[Path]]], damaged: dict[str, str]
    ) -> None:
        """Start from a store folder's last commit."""
        for key, (meta, files) in arrays.items():
            self._entries[key] = Entry(meta, files)
            self._committed[key] = meta
        self._bytes = _chunk_bytes(self._committed.values(), len(self.roots))
        self._committed_bytes = list(self._bytes)
        self._damaged = damaged
        for key in [*arrays, *damaged]:
            self._names.add(key)

    def lookup(self, key: str) -> Entry:
        """``key``'s entry; raises for a missing or damaged key."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if key in self._damaged:
            raise CorruptionError(f"key {key!r}: {self._damaged[key]}")
        raise KeyNotFoundError(f"key {key!r} is not in store {str(self.root)!r}")

    def find(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[str]:
        """Every key stored, damaged or being put, sorted."""
        return sorted(self._entries.keys() | self._damaged.keys() | self._pending.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._entries or key in self._damaged or key in self._pending

    def __len__(self) -> int:
        return len(self._entries)

    def damaged(self) -> list[tuple[str, str]]:
        """(key, why) of every damaged key, sorted."""
        return sorted(self._damaged.items())

    def stored(self) -> list[str]:
        """Keys with an entry (neither damaged nor only being put), sorted."""
        return sorted(self._entries)

    def changed(self) -> bool:
        """Whether anything changed since the last commit."""
        return bool(self._purged) or any(e.dirty for e in self._entries.values())

    # ------------------------------------------------------------------ in flight
    def key_busy(self, key: str, readers: bool) -> bool:
        """Whether ``key`` has a put or region write in flight (with ``readers``: or a read)."""
        entry = self._entries.get(key)
        busy = key in self._pending or self._region_writes[key] > 0
        return busy or (readers and entry is not None and entry.readers > 0)

    def chunks_busy(self, key: str, chunks: list[Chunk], *, in_place_write: bool) -> bool:
        """Whether a region operation on ``chunks`` must wait: a put of ``key`` or a write of
        one of them is in flight (for an in-place write, also a read of one of them)."""
        if key in self._pending or any(c in self._chunk_writes for c in chunks):
            return True
        return in_place_write and any(self._chunk_reads[c] for c in chunks)

    def add_puts(self, keys: list[str], claim: object) -> None:
        """Register ``claim``'s puts of ``keys`` (all or none: raises for a key that clashes)."""
        added: list[str] = []
        try:
            for key in keys:
                self._names.check(key)
                self._names.add(key)
                added.append(key)
        except BaseException:
            for key in added:
                self._names.remove(key)
            raise
        self._pending.update(dict.fromkeys(keys, claim))

    def drop_puts(self, keys: list[str], claim: object) -> None:
        for key in keys:
            if self._pending.get(key) is claim:
                del self._pending[key]
            self._names.remove(key)

    def add_read(self, entry: Entry, chunks: Iterable[Chunk] = ()) -> None:
        entry.readers += 1
        self._chunk_reads.update(chunks)

    def drop_read(self, entry: Entry, chunks: Iterable[Chunk] = ()) -> list[Path]:
        """Unregister a read; returns the files no read uses any more."""
        entry.readers -= 1
        self._chunk_reads.subtract(chunks)
        return entry.unused_files()

    def add_region_write(self, key: str, chunks: list[Chunk]) -> None:
        self._chunk_writes.update(chunks)
        self._region_writes[key] += 1

    def drop_region_write(self, entry: Entry, chunks: list[Chunk]) -> list[Path]:
        """Unregister a region write; returns the files no read uses any more."""
        self._chunk_writes.difference_update(chunks)
        self._region_writes[entry.meta.key] -= 1
        return entry.unused_files()

    # ------------------------------------------------------------------ changes
    def install(self, meta: ArrayMeta, paths: list[Path], *, staged: bool) -> Entry | None:
        """Make ``paths`` the current version of ``meta.key``; returns the superseded entry."""
        old = self._entries.get(meta.key)
        if self.saving:
            self._replaced.add(meta.key)
        chunks = set(range(len(paths))) if staged else set()
        self._entries[meta.key] = Entry(meta, paths, staged=chunks, dirty=True)
        _count(self._bytes, meta, 1)
        if old is not None:
            _count(self._bytes, old.meta, -1)
        if old is None and self._damaged.pop(meta.key, None) is None:
            self._names.add(meta.key)  # (a damaged key already counts as live)
        return old

    def install_region(
        self, entry: Entry, written: Iterable[tuple[int, Path, int]], *, staged: bool
    ) -> None:
        """Record a finished region write: ``(chunk index, new file, CRC)`` per chunk; with
        ``staged`` the new files replace the entry's (else they were written in place)."""
        crcs = list(entry.meta.crcs)
        for i, new, crc in written:
            if staged:
                if self.saving and i not in entry.saved:
                    entry.saved[i] = (entry.files[i], crcs[i], i in entry.staged)
                elif i in entry.staged:
                    entry.garbage.append(entry.files[i])
                entry.files[i] = new
                entry.staged.add(i)
            crcs[i] = crc
        entry.meta = dataclasses.replace(entry.meta, crcs=tuple(crcs))
        entry.dirty = True

    # ------------------------------------------------------------------ savepoint
    def check_savepoint(self, key: str) -> None:
        """Raise unless ``key`` can return to the savepoint."""
        if not self.saving:
            raise SavepointError(f"no savepoint is set in store {str(self.root)!r}")
        if key in self._replaced:
            raise SavepointError(
                f"key {key!r} was put or deleted since the savepoint: only region writes "
                "can be rolled back"
            )

    def rollback(self, key: str, chunks: Iterable[int]) -> list[Path]:
        """Return ``chunks`` of ``key`` to their versions at the savepoint (those not rewritten
        since are already there); returns the files no read uses any more."""
        self.check_savepoint(key)
        entry = self.lookup(key)
        crcs = list(entry.meta.crcs)
        for i in chunks:
            saved = entry.saved.pop(i, None)
            if saved is None:
                continue
            path, crcs[i], was_staged = saved
            if i in entry.staged:
                entry.garbage.append(entry.files[i])
            entry.files[i] = path
            if was_staged:
                entry.staged.add(i)
            else:
                entry.staged.discard(i)
        entry.meta = dataclasses.replace(entry.meta, crcs=tuple(crcs))
        return entry.unused_files()

    def release_savepoint(self) -> list[Path]:
        """Forget the savepoint's versions; returns the files no read uses any more."""
        self.saving = False
        self._replaced.clear()
        doomed: list[Path] = []
        for entry in self._entries.values():
            if entry.saved:
                entry.forget_saved()
                doomed += entry.unused_files()
        return doomed

    def damage(self, key: str, why: str) -> Entry | None:
        """Report ``key`` as damaged; returns its entry (to retire)."""
        entry = self._entries.pop(key, None)
        self._committed.pop(key, None)
        self._damaged[key] = f"{why}; put the key again or delete it"
        if entry is not None:
            _count(self._bytes, entry.meta, -1)
        return entry

    def delete(self, key: str) -> Entry | None:
        """Remove ``key``; returns its entry (to retire), ``None`` for a damaged key."""
        entry = self._entries.pop(key, None)
        damaged = self._damaged.pop(key, None)
        if self.saving:
            self._replaced.add(key)
        if entry is None and damaged is None:
            raise KeyNotFoundError(f"key {key!r} is not in store {str(self.root)!r}")
        if entry is not None:
            _count(self._bytes, entry.meta, -1)
        self._names.remove(key)
        if damaged is not None:
            self._purged.add(key)
        return entry

    @staticmethod
    def retire(entry: Entry) -> list[Path]:
        """Mark a superseded entry; returns its files no read uses any more."""
        entry.retired = True
        return entry.unused_files()

    # ------------------------------------------------------------------ commits
    @property
    def committed(self) -> Mapping[str, ArrayMeta]:
        """The metadata of every key at the last commit."""
        return self._committed

    def current(self) -> dict[str, ArrayMeta]:
        return {key: entry.meta for key, entry in self._entries.items()}

    def spare_room(self) -> list[int]:
        """The bytes each folder's spare pool may hold: as many as its chunks, in the current
        arrays or in the last commit's, whichever hold more (kept up to date as keys change,
        without a walk over them). Disk use stays within 2x; the staged versions that newer
        ones supersede before any commit (a new key rewritten) are recycled too."""
        return [max(a, b) for a, b in zip(self._bytes, self._committed_bytes, strict=True)]

    def changed_files(self) -> dict[str, list[str | None]]:
        """Each key changed since the last commit -> the relpaths of its staged chunk files by
        chunk index (``None`` for a chunk in place), as :func:`~tierswap.store._plan.plan_changes`
        takes them."""
        return {
            key: [
                self._qualified(entry.meta.folder_of(i), p) if i in entry.staged else None
                for i, p in enumerate(entry.files)
            ]
            for key, entry in self._entries.items()
            if entry.dirty
        }

    def _qualified(self, folder: int, path: Path) -> str:
        return qualify(folder, str(path.relative_to(self.roots[folder])))

    def purged(self) -> list[str]:
        """Damaged keys deleted since the last commit."""
        return sorted(self._purged)

    def mark_committed(self, current: dict[str, ArrayMeta]) -> None:
        """A commit of ``current`` succeeded: every chunk file is in its final place."""
        for entry in self._entries.values():
            if entry.dirty:
                meta = entry.meta
                entry.files = [
                    locate(self.roots, meta.chunk_qualified(i)) for i in range(meta.nchunks)
                ]
                entry.staged, entry.dirty = set(), False
        self._committed = current
        self._committed_bytes = list(self._bytes)  # current: the entries, counted as they change
        self._purged.clear()


def _chunk_bytes(metas: Iterable[ArrayMeta], folders: int) -> list[int]:
    """The chunk bytes of ``metas`` per folder (of ``folders``), as :func:`_count` adds them."""
    counts = [0] * folders
    for meta in metas:
        _count(counts, meta, 1)
    return counts


def _count(counts: list[int], meta: ArrayMeta, sign: int) -> None:
    """Add (``sign`` 1) or remove (-1) the chunk bytes of ``meta`` in ``counts``, per folder
    (whole chunks: the size a spare of them has)."""
    if not meta.folders:
        counts[0] += sign * meta.nchunks * meta.chunk_bytes
    for folder in meta.folders:
        counts[folder] += sign * meta.chunk_bytes


class PutClaim:
    """Puts of ``keys`` in flight: a key is in the store (``in``, ``keys()``) from the moment
    its put starts until it ends (then it is stored, or gone if the put failed). It waits for
    the key's put or region write in flight (with ``wait_reads``, for a scratch store's put,
    which renames over the files that reads use: its reads too)."""

    def __init__(self, index: StoreIndex, keys: list[str], *, wait_reads: bool) -> None:
        self._index, self._keys, self._wait_reads = index, list(keys), wait_reads

    def busy(self) -> bool:
        return any(self._index.key_busy(key, self._wait_reads) for key in self._keys)

    def take(self) -> None:
        self._index.add_puts(self._keys, self)

    def give_back(self) -> None:
        self._index.drop_puts(self._keys, self)

    def settle(self) -> None:
        pass


class ReadClaim:
    """A read of ``key``'s current entry (:attr:`entry` once taken), waiting for the key's put
    and region writes in flight; the entry's superseded files outlive the read.

    With ``wait=False`` it waits for nothing but an exclusive section, and a key that is not
    (or no longer) stored leaves :attr:`found` false instead of raising (``verify``).
    """

    def __init__(self, index: StoreIndex, key: str, discard: Discard, *, wait: bool = True) -> None:
        self._index, self._key, self._discard, self._wait = index, key, discard, wait
        self._entry: Entry | None = None
        self._doomed: list[Path] = []

    @property
    def found(self) -> bool:
        return self._entry is not None

    @property
    def entry(self) -> Entry:
        if self._entry is None:
            raise RuntimeError(f"no entry of key {self._key!r} was claimed")
        return self._entry

    def busy(self) -> bool:
        return self._wait and self._index.key_busy(self._key, False)

    def take(self) -> None:
        entry = self._index.lookup(self._key) if self._wait else self._index.find(self._key)
        if entry is not None:
            self._index.add_read(entry)
        self._entry = entry

    def give_back(self) -> None:
        if self._entry is not None:
            self._doomed = self._index.drop_read(self._entry)

    def settle(self) -> None:
        self._discard(self._doomed)
