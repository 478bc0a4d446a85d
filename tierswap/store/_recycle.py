"""Spare chunk files: superseded versions kept as the targets of later writes.

A durable store never overwrites a committed chunk: each new version goes to a new staged file,
renamed over the old one at the commit. Allocating that file costs: on ext4 over a virtio disk,
fio measured writes into new files at 1.6-1.75 GB/s and overwrites of allocated blocks at
2.1-2.4 GB/s. So the old versions are not deleted but kept here, in ``.tierswap/spare/``, and a
later write of a chunk of the same size renames one into staging and overwrites it in place.
The commit protocol is unchanged: the spare holds no data anyone needs (a superseded version),
and it is written under a staging name, made visible only by a commit.

One rule bounds what may be recycled: a file with another name (a snapshot links it, see
:func:`tierswap.store._snapshot.is_shared`) is never written in place; it leaves the pool and
keeps its other name. The pool holds at most ``cap`` bytes, so the store's disk use stays
within twice the state. A store on several folders keeps one pool per folder (a spare is
renamed into staging, so it must stay on its folder's filesystem).

A file over the cap is deleted on a thread of the pool's own: on ext4 deleting a 16 MiB file
takes about 4 ms (its extents are freed), and a commit that follows several steps of
savepoints hands the pool a superseded version of every chunk (0.9 s for 4 GiB, measured), which
it would else wait for. Until the thread has deleted them, the disk holds those files too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierswap.store._snapshot import is_shared

__all__ = ["SPARE", "SparePool"]

#: Folder of spare files inside the store's private folder.
SPARE = "spare"


class SparePool:
    """Spare chunk files by size, in one folder (wiped when the store opens).

    Thread safety: every method may be called from any thread (one lock; renames and unlinks
    of files that left the index run outside it).
    """

    def __init__(self, folder: Path, names: Iterator[int] | None = None) -> None:
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)  # leftovers of an earlier writer
        self.cap = 0
        self._free: dict[int, list[Path]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        # Numbers for new names; pools of one store share them, since a commit names a spare
        # (a path inside a folder) before knowing which folder's pool adopts it.
        self._names = itertools.count() if names is None else names
        self.reused = 0
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="tierswap-spares")  # (lazily)

    def new_path(self) -> Path:
        """A fresh name in the pool's folder (for a commit that moves a file here)."""
        return self.folder / f"f{next(self._names)}"

    def take(self, file_size: int, target: Path) -> bool:
        """Move a spare of ``file_size`` bytes to ``target``; ``False`` when there is none."""
        while True:
            with self._lock:
                free = self._free.get(file_size)
                if not free:
                    return False
                spare = free.pop()
                self._bytes -= file_size
            if is_shared(spare):  # a snapshot still links it: never write it in place
                _unlink(spare)
                continue
            try:
                os.replace(spare, target)
            except FileNotFoundError:
                continue
            with self._lock:
                self.reused += 1
            return True

    def keep(self, paths: Iterable[Path]) -> None:
        """Take superseded files into the pool (moving them into its folder), or delete them
        when they are shared or the pool is full."""
        for path in paths:
            self._add(path, moved=False)

    def adopt(self, paths: Iterable[Path]) -> None:
        """Index files a commit has already moved into the pool's folder."""
        for path in paths:
            self._add(path, moved=True)

    def _add(self, path: Path, *, moved: bool) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if is_shared(path):  # a snapshot links it: only this name goes (cheap)
            _unlink(path)
            return
        if not moved:  # into the pool's folder, under a fresh name (the old one may be reused)
            target = self.new_path()
            try:
                self.folder.mkdir(exist_ok=True)
                os.replace(path, target)
            except OSError:
                _unlink(path)
                return
            path = target
        with self._lock:
            room = self._bytes + size <= self.cap
            if room:
                self._bytes += size
                self._free.setdefault(size, []).append(path)
        if not room:  # deleted behind the caller (see the module's docstring)
            self._deleter.submit(_delete, path)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def settle(self) -> None:
        """Wait until the files over the cap handed to the pool so far are deleted."""
        self._deleter.submit(lambda: None).result()

    def clear(self) -> None:
        """Delete every spare (the store closes), after the deletions under way."""
        self._deleter.shutdown(wait=True)
        with self._lock:
            self._free.clear()
            self._bytes = 0
        shutil.rmtree(self.folder, ignore_errors=True)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _delete(path: Path) -> None:
    """The deleting thread's unlink: a file it cannot delete stays until the store next
    opens, which wipes the pool's folder (a file over the cap is never one the index names)."""
    with contextlib.suppress(OSError):
        path.unlink()
