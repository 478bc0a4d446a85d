"""The disk states a power cut may leave, built from a trace of file-system events.

Persistence model
-----------------
The trace is replayed on an inode-level model of the watched folder, so a rename moves an inode
and a hard link shares one. A **barrier** makes durable what completed before it *started*:

- ``syncfs``/``sync``: every operation (the watched folder is one filesystem);
- ``fsync``/``fdatasync`` of a file: that file's data writes and size changes, *not* the
  directory entry that names it (POSIX promises no more; ext4 happens to commit more);
- ``fsync`` of a directory: the entries created, removed or renamed *into* it.

At a crash point (the start of each barrier, and the trace's end) every operation that started
before it and is not durable may be lost. Two models choose what survives:

``ext4`` (the default, for ext4 with ``data=ordered``):
    Metadata (creations, renames, links, unlinks, directory changes, truncations) goes through
    one journal committed in order, so a crash keeps a **prefix** of the unsynced metadata
    operations. Data writes are not ordered with it: ``data=ordered`` only keeps a newly
    allocated block from being exposed before its data is written, while overwrites in place
    and delayed allocation let any page of unsynced data be lost independently of the
    metadata. So each unsynced 4 KiB page of data survives or not on its own (torn writes
    included), and a file whose size change survived but whose data did not reads as zeros.
``reorder`` (weaker than any journaling filesystem):
    Any subset of the unsynced operations survives, each independently, applied in trace
    order; an operation whose source no longer exists is skipped.

A trace may begin on a folder that already holds files (the trace of a recovery):
:func:`folder_events` rebuilds them as operations that are durable from the start.

Every state either model yields is one the harness checks. The ``ext4`` states are a superset
of what ext4 can produce, because a real ``fsync`` of a file commits the whole journal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.store.powerloss.trace import Event, TraceError

PAGE = 4096
ROOT = 1  # the watched folder's inode


@dataclasses.dataclass(frozen=True)
class Op:
    """One inode-level change. ``parent``/``name``: the entry an op adds or removes (a rename's
    source); ``parent2``/``name2``: a rename's destination."""

    kind: str
    start: int
    end: int
    inode: int
    parent: int = 0
    name: str = ""
    parent2: int = 0
    name2: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0


@dataclasses.dataclass(frozen=True)
class Barrier:
    scope: str  # "fs", "file" or "dir"
    start: int
    end: int
    inode: int = 0

    def covers(self, op: Op) -> bool:
        if self.scope == "fs":
            return True
        if self.scope == "file":
            return op.kind in ("write", "truncate") and op.inode == self.inode
        if op.kind == "rename":
            return op.parent2 == self.inode
        return op.kind in ("create", "mkdir", "link", "unlink", "rmdir") and op.parent == self.inode


@dataclasses.dataclass
class Trace:
    """A run's operations, barriers and markers, inode-level."""

    ops: list[Op]
    barriers: list[Barrier]
    markers: list[tuple[str, int]]  # (text, end)
    durable_prefix: int = 0  # the first ops rebuild the folder as it was: on disk from the start


class _Names:
    """The live namespace while the trace is replayed: which inode each path names."""

    def __init__(self, base: Path) -> None:
        self.base = str(base)
        self.dirs: dict[int, dict[str, int]] = {ROOT: {}}
        self.next = ROOT + 1

    def split(self, path: str) -> tuple[int, str]:
        rel = os.path.relpath(path, self.base)
        *parents, name = rel.split("/")
        node = ROOT
        for part in parents:
            node = self.dirs[node][part]  # a KeyError here: the trace missed a mkdir
        return node, name

    def lookup(self, path: str) -> int:
        if os.path.normpath(path) == self.base:
            return ROOT
        parent, name = self.split(path)
        if name not in self.dirs[parent]:
            raise TraceError(f"{path} is used but the trace never created it")
        return self.dirs[parent][name]

    def new(self, directory: bool) -> int:
        self.next += 1
        if directory:
            self.dirs[self.next] = {}
        return self.next


def build(events: Sequence[Event], base: Path, *, initial: Sequence[Event] = ()) -> Trace:
    """Replay ``events`` (under ``base``) inode by inode. ``base`` was empty when they began,
    or held what the ``initial`` events make (:func:`folder_events`), all of it durable."""
    names, ops, barriers, markers = _Names(base), [], [], []
    for e in initial:
        ops.extend(_ops(names, e, {"start": e.start, "end": e.end}))
    prefix = len(ops)
    for e in events:
        span = {"start": e.start, "end": e.end}
        if e.kind == "marker":
            markers.append((e.path, e.end))
        elif e.kind in ("fsync", "fdatasync", "syncfs", "sync"):
            barriers.append(_barrier(names, e))
        else:
            ops.extend(_ops(names, e, span))
    return Trace(ops, barriers, markers, durable_prefix=prefix)


def folder_events(base: Path) -> list[Event]:
    """The events that make the folders and files under ``base`` as they are now (hard
    links as links), placed before any traced call: the start of a trace of a recovery."""
    events, first = [], {}
    for parent, dirs, files in os.walk(base):
        dirs.sort()
        for name in dirs:
            events.append(Event("mkdir", -1, -1, path=os.path.join(parent, name)))
        for name in sorted(files):
            path = os.path.join(parent, name)
            inode = os.stat(path).st_ino
            if inode in first:
                events.append(Event("link", -1, -1, path=first[inode], dest=path))
                continue
            first[inode] = path
            events.append(Event("open", -1, -1, path=path, flags=frozenset({"O_CREAT"})))
            data = Path(path).read_bytes()
            if data:
                events.append(Event("write", -1, -1, path=path, data=data))
    return events


def _barrier(names: _Names, e: Event) -> Barrier:
    if e.kind in ("syncfs", "sync"):
        return Barrier("fs", e.start, e.end)
    inode = names.lookup(e.path)
    return Barrier("dir" if inode in names.dirs else "file", e.start, e.end, inode)


def _ops(names: _Names, e: Event, span: dict[str, int]) -> list[Op]:
    if e.kind == "open":
        parent, name = names.split(e.path)
        inode = names.dirs[parent].get(name)
        if inode is None:
            inode = names.new(directory=False)
            names.dirs[parent][name] = inode
            return [Op("create", inode=inode, parent=parent, name=name, **span)]
        return [Op("truncate", inode=inode, size=0, **span)] if "O_TRUNC" in e.flags else []
    if e.kind == "write":
        return [Op("write", inode=names.lookup(e.path), offset=e.offset, data=e.data, **span)]
    if e.kind == "truncate":
        return [Op("truncate", inode=names.lookup(e.path), size=e.size, **span)]
    if e.kind == "mkdir":
        parent, name = names.split(e.path)
        inode = names.new(directory=True)
        names.dirs[parent][name] = inode
        return [Op("mkdir", inode=inode, parent=parent, name=name, **span)]
    parent, name = names.split(e.path)
    inode = names.dirs[parent][name]
    if e.kind in ("unlink", "rmdir"):
        del names.dirs[parent][name]
        return [Op(e.kind, inode=inode, parent=parent, name=name, **span)]
    parent2, name2 = names.split(e.dest)
    if e.kind == "link":
        names.dirs[parent2][name2] = inode
        return [Op("link", inode=inode, parent=parent2, name=name2, **span)]
    if names.dirs[parent2].get(name2) == inode:
        return []  # renaming a name onto a hard link of the same inode does nothing
    del names.dirs[parent][name]
    names.dirs[parent2][name2] = inode
    return [
        Op("rename", inode=inode, parent=parent, name=name, parent2=parent2, name2=name2, **span)
    ]


# -- one crash state ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unit:
    """What survives or not as one piece: a whole op, or one page of a data write."""

    op: int  # index into Trace.ops
    page: int = -1  # for a write: which of its pages (-1: not a write)


class CrashFs:
    """The watched folder after a chosen set of units reached the disk, in trace order."""

    def __init__(self) -> None:
        self.dirs: dict[int, dict[str, int]] = {ROOT: {}}
        self.files: dict[int, bytearray] = {}

    def apply(self, op: Op, pages: set[int] | None = None) -> None:
        """Apply ``op``; for a write, only the pages in ``pages`` (all when None)."""
        d = self.dirs
        if op.kind == "write":
            self._write(op, pages)
        elif op.kind == "truncate":
            buf = self.files.setdefault(op.inode, bytearray())
            del buf[op.size :]
            buf.extend(bytes(op.size - len(buf)))
        elif op.kind in ("create", "mkdir", "link"):
            if op.kind == "mkdir":
                d.setdefault(op.inode, {})
            else:
                self.files.setdefault(op.inode, bytearray())
            d.setdefault(op.parent, {}).setdefault(op.name, op.inode)
        elif op.kind in ("unlink", "rmdir"):  # a folder removed is gone, whatever it holds
            if d.get(op.parent, {}).get(op.name) == op.inode:
                del d[op.parent][op.name]
        elif op.kind == "rename" and d.get(op.parent, {}).get(op.name) == op.inode:
            target = d.setdefault(op.parent2, {}).get(op.name2)
            if target is None or not d.get(target):  # never over a non-empty folder
                del d[op.parent][op.name]
                d[op.parent2][op.name2] = op.inode

    def _write(self, op: Op, pages: set[int] | None) -> None:
        buf = self.files.setdefault(op.inode, bytearray())
        for i, (lo, hi) in enumerate(_pages(op)):
            if pages is None or i in pages:
                if len(buf) < hi:
                    buf.extend(bytes(hi - len(buf)))
                buf[lo:hi] = op.data[lo - op.offset : hi - op.offset]

    def walk(self) -> Iterator[tuple[str, int]]:
        """(relative path, inode) of every reachable entry, parents first."""
        stack = [("", ROOT)]
        while stack:
            prefix, node = stack.pop()
            for name, inode in sorted(self.dirs.get(node, {}).items()):
                path = f"{prefix}{name}"
                yield path, inode
                if inode in self.dirs:
                    stack.append((path + "/", inode))

    def digest(self) -> str:
        """Names, contents and hard-link identity: equal digests are equal disk states."""
        h, first = hashlib.sha256(), {}
        for path, inode in sorted(self.walk()):
            alias = first.setdefault(inode, path)
            body = b"D" if inode in self.dirs else hashlib.sha256(self.files[inode]).digest()
            h.update(f"{path}\0{alias}\0".encode() + body)
        return h.hexdigest()

    def write_to(self, dest: Path) -> None:
        """Make the state real under ``dest`` (which must exist and be empty)."""
        first: dict[int, Path] = {}
        for rel, inode in self.walk():
            path = dest / rel
            if inode in self.dirs:
                path.mkdir()
            elif inode in first:
                os.link(first[inode], path)
            else:
                path.write_bytes(bytes(self.files[inode]))
                first[inode] = path


def _pages(op: Op) -> list[tuple[int, int]]:
    """The file ranges of ``op``'s data, cut at page boundaries."""
    lo, end, out = op.offset, op.offset + len(op.data), []
    while lo < end:
        hi = min(end, (lo // PAGE + 1) * PAGE)
        out.append((lo, hi))
        lo = hi
    return out


# -- every crash state -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """Where the power went: ``position`` in the trace, and the markers passed by then."""

    position: int
    markers: tuple[str, ...]


@dataclasses.dataclass
class CrashState:
    point: CrashPoint
    fs: CrashFs
    lost: int  # how many unsynced units did not survive


def crash_points(trace: Trace) -> list[int]:
    """The start of every barrier, and the end of the trace."""
    ends = [op.end for op in trace.ops] + [b.end for b in trace.barriers]
    return sorted({b.start for b in trace.barriers} | {max(ends, default=0) + 1})


def states(
    trace: Trace, *, model: str = "ext4", randoms: int = 8, seed: int = 0
) -> Iterator[CrashState]:
    """Every distinct crash state at every crash point (see the module's docstring)."""
    if model not in ("ext4", "reorder"):
        raise ValueError(f"model={model!r}: 'ext4' or 'reorder'")
    rng, seen = random.Random(seed), set()
    for position in crash_points(trace):
        point = CrashPoint(position, tuple(t for t, end in trace.markers if end < position))
        durable, unsynced = _split(trace, position)
        choices = (
            _ext4(trace, unsynced, rng, randoms)
            if model == "ext4"
            else _reorder(unsynced, rng, randoms)
        )
        for survivors in choices:
            fs = _replay(trace, durable, survivors)
            key = fs.digest()
            if key not in seen:
                seen.add(key)
                yield CrashState(point, fs, len(unsynced) - len(survivors))


def _split(trace: Trace, position: int) -> tuple[set[int], list[Unit]]:
    """(durable op indexes, unsynced units in trace order) at a crash at ``position``."""
    done = [b for b in trace.barriers if b.end < position]
    durable, unsynced = set(), []
    for i, op in enumerate(trace.ops):
        if op.start >= position:
            continue
        if i < trace.durable_prefix or any(op.end < b.start and b.covers(op) for b in done):
            durable.add(i)
        elif op.kind == "write":
            unsynced.extend(Unit(i, p) for p in range(len(_pages(op))))
        else:
            unsynced.append(Unit(i))
    return durable, unsynced


def _ext4(trace: Trace, units: list[Unit], rng: random.Random, randoms: int) -> Iterator[set[Unit]]:
    meta = [u for u in units if u.page < 0]
    data = [u for u in units if u.page >= 0]
    for j in range(len(meta) + 1):
        kept = set(meta[:j])
        cut = trace.ops[meta[j].op].end if j < len(meta) else float("inf")
        yield kept | set(data)
        yield kept
        yield kept | {u for u in data if trace.ops[u.op].end < cut}  # a kill -9 at meta[j]
    for u in data:
        yield set(meta) | (set(data) - {u})
    for _ in range(randoms):
        j = rng.randint(0, len(meta))
        yield set(meta[:j]) | {u for u in data if rng.random() < 0.5}


def _reorder(units: list[Unit], rng: random.Random, randoms: int) -> Iterator[set[Unit]]:
    everything = set(units)
    yield everything
    yield set()
    for u in units:
        yield everything - {u}
        yield {u}
    for _ in range(randoms):
        yield {u for u in units if rng.random() < 0.5}


def _replay(trace: Trace, durable: set[int], survivors: set[Unit]) -> CrashFs:
    pages: dict[int, set[int]] = {}
    whole = set(durable)
    for u in survivors:
        if u.page < 0:
            whole.add(u.op)
        else:
            pages.setdefault(u.op, set()).add(u.page)
    fs = CrashFs()
    for i, op in enumerate(trace.ops):
        if i in whole:
            fs.apply(op)
        elif i in pages:
            fs.apply(op, pages[i])
    return fs
