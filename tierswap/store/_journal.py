"""Crash-safe commits: staged files, a journal as the single commit point, then roll-forward.

A durable commit never overwrites committed bytes before the commit point:

1. new chunk and metadata files are written (and fdatasync'ed) under ``.tierswap/staging/``;
2. the journal, listing every rename, unlink and rmdir the commit needs, is written to a
   temporary file, fsync'ed and renamed to ``.tierswap/journal.json``: **the commit point**;
3. roll-forward removes superseded files, renames staged files over their targets (first
   moving a replaced chunk aside as a spare write target where the plan says so, see
   :mod:`tierswap.store._recycle`), fsyncs the touched directories and deletes the journal.

In a store on several folders the journal lives in the home; the paths of the plan are
*qualified* (:func:`tierswap.store._layout.qualify`), so one journal moves, recycles and unlinks
chunk files in every folder, each within its own folder (a staged chunk is written in the
folder it will live in), and the home's journal is the one commit point of them all.

Every roll-forward step is idempotent (rename only what is still staged; unlinks never name a
rename target), so a writer that finds a journal on open simply rolls it forward again. A crash
before step 2 leaves only staged files, which the next writer discards: the store is at its last
commit. Each byte is written once per commit, and disk use peaks at old state + new state.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tierswap.errors import CorruptionError
from tierswap.store._layout import locate

__all__ = [
    "HAVE_SYNCFS",
    "JOURNAL",
    "apply_in_place",
    "commit_durable",
    "STAGING",
    "CommitPlan",
    "atomic_write_bytes",
    "fdatasync_path",
    "fsync_dir",
    "mkdirs_durable",
    "read_journal",
    "roll_forward",
    "syncfs",
    "write_journal",
]

JOURNAL = "journal.json"
STAGING = "staging"


@dataclasses.dataclass(frozen=True)
class CommitPlan:
    """The file operations that move a store from one generation to the next.

    Paths are relative to the store root (qualified, in a store on several folders).
    ``unlinks`` and rename targets are disjoint, and ``rmdirs`` are listed deepest first
    (within each folder).
    """

    generation: int
    moves: tuple[tuple[str, str], ...]
    unlinks: tuple[str, ...] = ()
    rmdirs: tuple[str, ...] = ()
    #: (final, spare): before a staged file replaces ``final``, the old ``final`` moves to
    #: ``spare`` (a superseded version kept as a later write target) instead of being dropped.
    recycle: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CommitPlan:
        raw = json.loads(data)
        return cls(
            generation=int(raw["generation"]),
            moves=tuple((str(a), str(b)) for a, b in raw["moves"]),
            unlinks=tuple(raw["unlinks"]),
            rmdirs=tuple(raw["rmdirs"]),
            recycle=tuple((str(a), str(b)) for a, b in raw.get("recycle", ())),
        )


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdirs_durable(path: Path) -> None:
    """Create folder ``path`` and its missing parents, and make their entries durable: a
    marker that names a folder must not outlive the folder itself after a power cut."""
    if path.is_dir():
        return  # the common case (a chunk's staging folder): one stat
    if path.exists():
        raise FileExistsError(errno.EEXIST, "a file exists where a directory should be", str(path))
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    if missing:
        missing[0].mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


def atomic_write_bytes(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Replace ``path`` with ``data``: write ``*.partial``, fsync, rename; no torn file ever."""
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if sync:
                fh.flush()
                os.fdatasync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if sync:
        fsync_dir(path.parent)


def write_journal(internal: Path, plan: CommitPlan) -> None:
    """Write the journal durably. Once this returns, the commit has happened."""
    atomic_write_bytes(internal / JOURNAL, plan.to_json(), sync=True)


def read_journal(internal: Path) -> CommitPlan | None:
    """The journal of a commit that was not fully rolled forward, if any."""
    try:
        data = (internal / JOURNAL).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return CommitPlan.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"commit journal {str(internal / JOURNAL)!r} is damaged") from exc


Roots = Path | Sequence[Path]


def _roots(root: Roots) -> Sequence[Path]:
    """The store's folders, home first (one folder given as a path)."""
    return [root] if isinstance(root, Path) else root


def roll_forward(
    root: Roots,
    internal: Path,
    plan: CommitPlan,
    sync_dirs: Callable[[Iterable[Path]], None],
) -> None:
    """Apply ``plan`` (idempotently), make it durable, then drop the journal. ``root`` is the
    store folder, or the store's folders (home first)."""
    roots = _roots(root)
    touched = _remove_superseded(roots, plan)
    spares = dict(plan.recycle)
    # not yet moved (a crash may have moved the old version aside only)
    pending = {(src, dst) for src, dst in plan.moves if locate(roots, src).exists()}
    # A staged file moved into a folder whose own entry is not yet durable could vanish with
    # that folder in a power cut, while the journal says it moved: folders first, durably.
    folders = {locate(roots, dst).parent for _src, dst in pending}
    folders |= {locate(roots, spares[dst]).parent for _src, dst in pending if dst in spares}
    for folder in sorted(folders):
        mkdirs_durable(folder)
    for src_rel, dst_rel in plan.moves:
        src, dst = locate(roots, src_rel), locate(roots, dst_rel)
        if (src_rel, dst_rel) in pending:
            spare_rel = spares.get(dst_rel)
            if spare_rel is not None and dst.exists():
                spare = locate(roots, spare_rel)
                os.replace(dst, spare)
                touched.add(spare.parent)
            os.replace(src, dst)
        touched.add(dst.parent)
    sync_dirs(sorted(p for p in touched if p.exists()))
    (internal / JOURNAL).unlink()
    fsync_dir(internal)


def _remove_superseded(roots: Sequence[Path], plan: CommitPlan) -> set[Path]:
    """Unlink ``plan.unlinks`` and remove the emptied ``plan.rmdirs`` (each step idempotent);
    return the folders whose entries changed."""
    touched: set[Path] = set()
    for rel in plan.unlinks:
        path = locate(roots, rel)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        touched.add(path.parent)
    for rel in plan.rmdirs:
        path = locate(roots, rel)
        with contextlib.suppress(OSError):  # already gone, or not empty
            path.rmdir()
        touched.add(path.parent)
    return touched


def commit_durable(
    root: Roots,
    staging: Path,
    plan: CommitPlan,
    documents: list[tuple[str, bytes]],
    *,
    sync_files: Callable[[list[Path]], None],
    sync_dirs: Callable[[Iterable[Path]], None],
) -> None:
    """Stage ``documents`` (final relpath, bytes), pass the commit point, roll forward.

    ``plan.moves`` holds the chunk moves; the documents' moves are added here. ``sync_files``
    must make the staged documents (and, where the chunk writes skipped it, the staged chunks)
    durable. If anything fails before the commit point, the staged documents are removed and
    the store is unchanged.
    """
    internal, home = staging.parent, _roots(root)[0]
    mkdirs_durable(staging)
    staged = [
        (staging / f"m{plan.generation}.{i}.json", dst) for i, (dst, _data) in enumerate(documents)
    ]
    moves = plan.moves + tuple((str(src.relative_to(home)), dst) for src, dst in staged)
    plan = dataclasses.replace(plan, moves=moves)
    try:
        for (src, _dst), (_rel, data) in zip(staged, documents, strict=True):
            src.write_bytes(data)
        sync_files([src for src, _dst in staged])
        fsync_dir(staging)
        write_journal(internal, plan)  # <- the commit point
    except BaseException:
        for src, _dst in staged:
            with contextlib.suppress(FileNotFoundError):
                src.unlink()
        raise
    roll_forward(root, internal, plan, sync_dirs)
    # the staging folder stays (empty) for the next commit's writes, which would otherwise
    # create it again and fsync its parent; a writer's open and close remove it


def apply_in_place(root: Roots, plan: CommitPlan, documents: list[tuple[str, bytes]]) -> None:
    """Scratch-mode commit: write documents and remove superseded files, without fsync."""
    roots = _roots(root)
    _remove_superseded(roots, plan)
    for rel, data in documents:
        path = locate(roots, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data, sync=False)


def fdatasync_path(path: Path) -> None:
    """Make the data of the file at ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux/glibc: callers fall back to per-file syncs
        return None


_SYNCFS = _load_syncfs()
#: True where one ``syncfs`` can replace many per-file ``fdatasync`` calls.
HAVE_SYNCFS = _SYNCFS is not None


def syncfs(path: Path) -> None:
    """Flush every dirty page and inode of the filesystem holding ``path`` (one call, not one
    per file); raises the ``OSError`` of a failed writeback."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available on this platform")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)
