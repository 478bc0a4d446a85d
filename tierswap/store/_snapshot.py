"""Snapshots: a store's last commit kept as a standalone store, sharing its chunk files.

A committed chunk file is never written again: a new version is written to a new file and
renamed over the old name, and superseded files are unlinked. So the files of one commit can be
kept by **hard links**: the snapshot holds its own names for the same inodes, no data byte is
copied, and whatever the live store does next (commit, crash, delete its folder) only drops the
live store's names. The small metadata documents (``zarr.json``) are copied, never linked. The
lock, the journal and the staging folder are never part of a snapshot.

When the destination is on another filesystem the chunk files are first pinned by hard links
in the store's private folder (so the live store may commit meanwhile), then copied: reflinked
(``FICLONE``) where the filesystem shares blocks, else through ``os.copy_file_range``, else a
plain copy, with an optional progress bar (``rich``).

The snapshot is built in a hidden sibling of the destination and renamed into place last: a
crash leaves either no snapshot or a complete one.

**Several folders.** A snapshot of a store on several folders is a store on as many folders:
either a list of destinations, one per source folder (put each on its source's drive and every
chunk is linked), or one destination, which then holds folder ``f`` at
``.tierswap/folder-<f>`` (see :func:`tierswap.store._layout.nested_folder`; chunks of other
drives are copied), so that a trainer checkpoint stays one folder. The snapshot's markers name
a new store (its own id) and list its own folders; its home alone opens it. A list of
destinations is renamed into place home last, so a crash between two renames leaves no home.

**The sharing rule.** A file whose link count is above one may belong to a snapshot. Code that
would write into an existing chunk file, or recycle a superseded chunk file as the target of a
new write, must call :func:`is_shared` first and leave a shared file alone. This is the one
place that rule lives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from tierswap.errors import (
    ConfigError,
    CorruptionError,
    NoCommitError,
    SnapshotExistsError,
    StoreLockedError,
    TierswapError,
)
from tierswap.store import _journal as journal
from tierswap.store._folder import StoreFolder
from tierswap.store._layout import INTERNAL_DIR, locate, nested_folder
from tierswap.store._members import Folder, marker_tags, new_store_id, store_paths

__all__ = [
    "PROGRESS_MIN_BYTES",
    "Progress",
    "SnapshotResult",
    "check_apart",
    "check_destination",
    "is_shared",
    "replace_with_snapshot",
    "take_snapshot",
]

#: Copies at least this large show a progress bar when ``progress=None`` and stderr is a tty.
PROGRESS_MIN_BYTES = 1 << 30
#: A progress callback: ``(bytes copied so far, bytes to copy)``.
Progress = Callable[[int, int], None]
#: Link errors after which the remaining files are copied instead.
_NO_LINK = frozenset((errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.ENOSYS))
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_PIN_PREFIX = "snapshot-pin-"
_ATTEMPTS = 8  # a snapshot without the writer's lock retries while commits interleave
#: One folder, or a list of them (a store's folders, home first).
Folders = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def is_shared(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` has another name (a snapshot may hold it).

    THE rule for every writer of chunk files: a shared file must never be modified in place
    nor recycled as the target of a new write; write a new file and rename it instead. A
    missing file is not shared.
    """
    try:
        return os.stat(path).st_nlink > 1
    except FileNotFoundError:
        return False


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    """What :func:`take_snapshot` made."""

    path: Path
    generation: int
    files: int
    linked_bytes: int  # chunk bytes shared with the source by hard links
    copied_bytes: int  # chunk and document bytes copied (or reflinked)


@dataclasses.dataclass
class _Capture:
    """Files of one generation captured into the partial snapshot or a pin folder."""

    generation: int = 0
    files: int = 0
    linked: int = 0
    copied: int = 0
    deferred: list[tuple[Path, Path]] = dataclasses.field(default_factory=list)  # pin -> dest
    pins: dict[Path, Path] = dataclasses.field(default_factory=dict)  # private folder -> pins

    def drop_pins(self) -> None:
        for pin in self.pins.values():
            shutil.rmtree(pin, ignore_errors=True)
        self.pins.clear()


# ============================================================================ public entry points
def take_snapshot(
    root: Folders,
    dest: Folders,
    *,
    hold: Callable[[], AbstractContextManager[object]] | None = None,
    progress: bool | Progress | None = None,
) -> SnapshotResult:
    """Make ``dest`` a standalone store holding the last commit of the store at ``root``.

    Parameters
    ----------
    root:
        The store folder (open or not, in this process or another), or its folders.
    dest:
        A missing or empty folder. On the same filesystem the chunk files are hard links.
        For a store on several folders, a list of as many (or one: see the module notes).
    hold:
        A context that keeps the store from committing (the writer's own gate). ``None``: the
        listing is checked against the store's commit point afterwards and retried when a
        writer committed meanwhile.
    progress:
        ``True`` a progress bar (needs ``rich``), ``False`` none, a callable
        ``(done, total)``, or ``None``: a bar for copies of :data:`PROGRESS_MIN_BYTES` or more
        when stderr is a terminal.
    """
    roots = StoreFolder.discover(_absolute(root))
    dests = _absolute(dest)
    return _take(roots, dests, dests, hold=hold, progress=progress)


def _take(
    roots: list[Path],
    dests: list[Path],
    finals: list[Path],
    *,
    hold: Callable[[], AbstractContextManager[object]] | None,
    progress: bool | Progress | None,
) -> SnapshotResult:
    """Snapshot the store on ``roots`` into ``dests``, which will end up at ``finals`` (the
    folders its markers name)."""
    _snapshot_roots(roots, dests)  # raises for a destination list of the wrong length
    check_destination(roots, dests)
    partials = [d.with_name(f".{d.name}.partial-snapshot-{os.getpid()}") for d in dests]
    for partial in partials:
        shutil.rmtree(partial, ignore_errors=True)
    capture = _Capture()
    try:
        capture = _capture(roots, partials, _snapshot_roots(roots, finals), hold)
        _transfer(capture, progress)
        for partial in partials:
            _make_durable(partial)
        for partial, final in reversed(list(zip(partials, dests, strict=True))):  # home last
            partial.rename(final)  # replaces an empty folder; a crash before leaves no home
            journal.fsync_dir(final.parent)
    except BaseException:
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        capture.drop_pins()
    return SnapshotResult(
        dests[0], capture.generation, capture.files, capture.linked, capture.copied
    )


def replace_with_snapshot(
    snapshot: Folders,
    dest: Folders,
    *,
    progress: bool | Progress | None = None,
) -> SnapshotResult:
    """Make the store folder ``dest`` (or folders) a copy (by links where possible) of
    ``snapshot``.

    Whatever store ``dest`` held is replaced; ``dest`` must not be open by a writer
    (:class:`~tierswap.errors.StoreLockedError`). ``snapshot`` itself is never modified.
    """
    sources, dests = _absolute(snapshot), _absolute(dest)
    if not (sources[0] / "zarr.json").exists():
        raise ConfigError(f"no store at {str(sources[0])!r} (no zarr.json); pass a snapshot folder")
    sources = StoreFolder.discover(sources)
    if all(not d.exists() or (d.is_dir() and not any(d.iterdir())) for d in dests):
        return _take(sources, dests, dests, hold=None, progress=progress)
    for folder in dests:
        is_store = (folder / "zarr.json").exists() or (folder / INTERNAL_DIR).is_dir()
        if folder.exists() and not is_store and any(folder.iterdir()):
            raise SnapshotExistsError(
                f"folder {str(folder)!r} is not empty and holds no store; pick a new or empty "
                "folder"
            )
    fresh = [d.with_name(f".{d.name}.restore-{os.getpid()}") for d in dests]
    trash = [d.with_name(f".{d.name}.replaced-{os.getpid()}") for d in dests]
    held = [d for d in dests if (d / INTERNAL_DIR).is_dir()]  # a writer holds these
    locks = StoreFolder(held) if held else None
    if locks is not None:
        locks.lock()
    try:
        result = _take(sources, fresh, dests, hold=None, progress=progress)
        for old, new, bin_ in reversed(list(zip(dests, fresh, trash, strict=True))):
            if old.exists():
                old.rename(bin_)
            new.rename(old)
            journal.fsync_dir(old.parent)
    finally:
        if locks is not None:
            locks.unlock()
        for folder in fresh:
            shutil.rmtree(folder, ignore_errors=True)
    for folder in trash:
        shutil.rmtree(folder, ignore_errors=True)
    return dataclasses.replace(result, path=dests[0])


def check_destination(root: Path | Sequence[Path], dest: Path | Sequence[Path]) -> None:
    """Raise unless ``dest`` (a folder, or folders) may receive a snapshot of the store on
    ``root`` (its folder, or folders); changes nothing."""
    roots = [root] if isinstance(root, Path) else list(root)
    for folder in [dest] if isinstance(dest, Path) else dest:
        for source in roots:
            check_apart(source, folder)
        if folder.exists() and not folder.is_dir():
            raise SnapshotExistsError(
                f"snapshot destination {str(folder)!r} is a file; pass a folder"
            )
        _check_unlocked(folder / INTERNAL_DIR)
        if folder.exists() and any(folder.iterdir()):
            raise SnapshotExistsError(
                f"snapshot destination {str(folder)!r} is not empty; pick a new or empty folder "
                "(a snapshot never overwrites files)"
            )


def _absolute(paths: Folders) -> list[Path]:
    return list(store_paths(paths))


def _snapshot_roots(roots: Sequence[Path], dests: Sequence[Path]) -> list[Path]:
    """The folders of a snapshot of the store on ``roots`` into ``dests``: the list itself,
    or one folder with the others nested in its private folder."""
    if len(dests) == len(roots):
        return list(dests)
    if len(dests) == 1:
        return [dests[0], *(dests[0] / nested_folder(i) for i in range(1, len(roots)))]
    raise ConfigError(
        f"the store spans {len(roots)} folders but {len(dests)} destinations were given; pass "
        f"one destination folder, or {len(roots)} (one per drive)"
    )


def check_apart(root: Path, dest: Path) -> None:
    """Raise :class:`~tierswap.errors.ConfigError` if one folder is (inside) the other."""
    if dest == root or dest.is_relative_to(root) or root.is_relative_to(dest):
        raise ConfigError(
            f"snapshot destination {str(dest)!r} overlaps the store {str(root)!r}; pick a "
            "folder outside it"
        )


def _check_unlocked(internal: Path) -> None:
    try:
        fd = os.open(internal, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # not a store folder
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise StoreLockedError(
            f"snapshot destination {str(internal.parent)!r} is a store open for writing; close "
            "that store and pick a new or empty folder"
        ) from exc
    finally:
        os.close(fd)  # releases the probe lock


# ============================================================================ capture
def _capture(
    roots: list[Path],
    partials: list[Path],
    finals: list[Path],
    hold: Callable[[], AbstractContextManager[object]] | None,
) -> _Capture:
    """Link (or copy) the files of one generation into ``partials``; retry while unstable."""
    for _attempt in range(_ATTEMPTS):
        with hold() if hold is not None else contextlib.nullcontext():
            before = None if hold is not None else _commit_token(roots[0])
            try:
                capture = _capture_once(roots, partials, finals)
            except (FileNotFoundError, CorruptionError):
                if hold is not None:
                    raise
                capture = None  # a writer moved files meanwhile
            if capture is not None and (hold is not None or _commit_token(roots[0]) == before):
                return capture
        if capture is not None:
            capture.drop_pins()
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
    raise TierswapError(
        f"store {str(roots[0])!r} kept committing while its files were listed ({_ATTEMPTS} "
        "tries); snapshot it from its writer (SwapStore.snapshot) or between commits"
    )


def _capture_once(roots: list[Path], partials: list[Path], finals: list[Path]) -> _Capture:
    folder = StoreFolder(roots)
    generation, files = folder.committed_files()
    if generation == 0:
        raise NoCommitError(
            f"store {str(roots[0])!r} has no commit yet; call commit() before taking a snapshot"
        )
    capture = _Capture(generation=generation, files=len(files))
    built = _snapshot_roots(roots, partials)
    for root in built:
        (root / INTERNAL_DIR).mkdir(parents=True)
    try:
        _capture_files(folder, built, files, capture)
    except BaseException:
        capture.drop_pins()
        raise
    if len(roots) > 1:  # a new store: its own id, and markers that list its own folders
        for root, tag in zip(built, marker_tags(finals, new_store_id()), strict=True):
            Folder(root).write_marker(tag)
    return capture


def _capture_files(
    folder: StoreFolder, built: list[Path], files: dict[str, Path], capture: _Capture
) -> None:
    linking = [True] * len(built)  # per source folder: hard links work to its destination
    for rel, src in sorted(files.items()):
        dst, index = locate(built, rel), folder.folder_of(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("zarr.json"):  # documents: always a private copy
            data = src.read_bytes()
            dst.write_bytes(data)
            capture.copied += len(data)
            continue
        size = src.stat().st_size
        if linking[index] and _try_link(src, dst):
            capture.linked += size
            continue
        linking[index] = False
        _pin(folder.folders[index].internal, src, dst, capture)


def _try_link(src: Path, dst: Path) -> bool:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return False
        raise
    return True


def _pin(internal: Path, src: Path, dst: Path, capture: _Capture) -> None:
    """Keep ``src`` for a copy after the capture: a hard link in the private folder
    ``internal`` of its store folder, or, where that filesystem has no hard links, a copy now."""
    pin = capture.pins.get(internal)
    if pin is None:
        _remove_stale_pins(internal)
        pin = capture.pins[internal] = internal / f"{_PIN_PREFIX}{os.getpid()}-{id(capture)}"
        with contextlib.suppress(OSError):
            pin.mkdir()
    pinned = pin / str(len(capture.deferred))
    try:
        os.link(src, pinned)
    except OSError:  # no hard links here (or no write access): copy while the files are held
        capture.copied += _copy_file(src, dst, None)
        return
    capture.deferred.append((pinned, dst))


def _remove_stale_pins(internal: Path) -> None:
    """Pin folders left by a process that died during a cross-filesystem snapshot."""
    for pin in internal.glob(f"{_PIN_PREFIX}*"):
        pid = int(pin.name.removeprefix(_PIN_PREFIX).split("-")[0] or 0)
        if not _alive(pid):
            shutil.rmtree(pin, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _commit_token(root: Path) -> tuple[object, ...]:
    """Changes whenever a commit passes its commit point or finishes rolling forward."""
    return tuple(
        _stat_token(path) for path in (root / INTERNAL_DIR / journal.JOURNAL, root / "zarr.json")
    )


def _stat_token(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


# ============================================================================ transfer
def _transfer(capture: _Capture, progress: bool | Progress | None) -> None:
    """Copy the pinned files into the snapshot, with progress."""
    total = sum(src.stat().st_size for src, _dst in capture.deferred)
    if not total:
        return
    with _progress(progress, total) as report:
        done = 0
        for src, dst in capture.deferred:

            def advance(nbytes: int) -> None:
                nonlocal done
                done += nbytes
                if report is not None:
                    report(done, total)

            capture.copied += _copy_file(src, dst, advance)


def _copy_file(src: Path, dst: Path, advance: Callable[[int], None] | None) -> int:
    """Copy ``src`` to a new file ``dst``: reflink, else ``copy_file_range``, else read/write."""
    size = src.stat().st_size
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        if _reflink(fin.fileno(), fout.fileno()):
            if advance is not None:
                advance(size)
        else:
            _copy_range(fin.fileno(), fout.fileno(), size, advance)
    return size


def _reflink(fd_in: int, fd_out: int) -> bool:
    try:
        fcntl.ioctl(fd_out, _FICLONE, fd_in)
    except OSError:
        return False
    return True


def _copy_range(fd_in: int, fd_out: int, size: int, advance: Callable[[int], None] | None) -> None:
    """Copy ``size`` bytes in the kernel where it can (``copy_file_range``), else by hand."""
    step, offset = 64 << 20, 0
    use_range = hasattr(os, "copy_file_range")
    while offset < size:
        count, copied = min(step, size - offset), 0
        if use_range:
            try:
                copied = os.copy_file_range(fd_in, fd_out, count, offset, offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_range = False
        if not copied:
            data = os.pread(fd_in, count, offset)
            if not data:
                raise CorruptionError(f"a chunk file ended at byte {offset} of {size} while copied")
            copied = os.pwrite(fd_out, data, offset)
        offset += copied
        if advance is not None:
            advance(copied)


@contextlib.contextmanager
def _progress(progress: bool | Progress | None, total: int) -> Iterator[Progress | None]:
    if callable(progress):
        yield progress
        return
    if progress is None:
        progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    if not progress:
        yield None
        return
    try:
        from rich.progress import DownloadColumn, Progress, TransferSpeedColumn
    except ImportError:  # rich is optional (the bench extra); no bar without it
        yield None
        return
    columns = (*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("snapshot copy", total=total)
        yield lambda done, _total: bar.update(task, completed=done)


def _make_durable(partial: Path) -> None:
    """Flush the snapshot's files and folders before it is renamed into place."""
    if journal.HAVE_SYNCFS:
        journal.syncfs(partial)
        return
    for dirpath, _dirs, names in os.walk(partial):
        for name in names:
            journal.fdatasync_path(Path(dirpath) / name)
        journal.fsync_dir(Path(dirpath))
