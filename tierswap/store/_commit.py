"""Commits of one store: the plan, how its writes are made durable, and applying it.

:class:`Committer` turns the store's index into a commit plan
(:func:`~tierswap.store._plan.plan_changes`) and applies it: crash-safely through the journal for
a durable store (:func:`~tierswap.store._journal.commit_durable`), in place for a scratch one.
:class:`SyncPolicy` decides how the written files and folders are flushed: per file, or with
one ``syncfs`` per commit phase.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError
from tierswap.io import IOEngine, gather, translate_os_error
from tierswap.store import _journal as journal
from tierswap.store._folder import StoreFolder
from tierswap.store._index import StoreIndex
from tierswap.store._plan import plan_changes
from tierswap.store._staging import ChunkTargets

__all__ = ["Committer", "SyncPolicy", "check_meta", "fsync_dirs"]


def fsync_dirs(dirs: Iterable[Path]) -> None:
    """Make the entries of ``dirs`` durable, one after the other (crash recovery, before a
    store's I/O pool exists)."""
    for path in dirs:
        journal.fsync_dir(path)


def check_meta(meta: dict[str, Any]) -> None:
    """Raise :class:`~tierswap.errors.ConfigError` unless ``meta`` can be stored as JSON."""
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"commit meta {meta!r} is not JSON-serialisable: {exc}") from exc


class SyncPolicy:
    """How one store makes its writes durable, folder by folder.

    :attr:`each_chunk` says, per store folder, whether each chunk file is fdatasync'ed as it
    is written. With O_DIRECT the bytes are already on the device; only their metadata (and
    the drive's cache) needs flushing, so a durable store defers that to one ``syncfs`` per
    commit phase where the platform has it. Buffered writes are synced per file, so that the
    pages can be dropped from the page cache at once. Scratch stores sync nothing per chunk.
    A folder is flushed by ``syncfs`` of its own filesystem; folders on one filesystem share
    one call.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, folder: StoreFolder, engines: list[IOEngine], *, durable: bool) -> None:
        self._folder = folder
        self._engine = engines[0]
        self.each_chunk = [durable and not (e.direct and journal.HAVE_SYNCFS) for e in engines]

    def files(self, paths: list[Path]) -> None:
        """Make the data of ``paths`` (the home's staged documents) durable, and every chunk
        left unsynced in a folder flushed by ``syncfs``."""
        if self.each_chunk[0]:
            self._parallel(journal.fdatasync_path, paths)
        self._syncfs()

    def dirs(self, dirs: Iterable[Path]) -> None:
        """Make the entries of ``dirs`` durable."""
        per_file = [d for d in dirs if self.each_chunk[self._folder.folder_of(d)]]
        self._parallel(journal.fsync_dir, per_file)
        self._syncfs()

    def _syncfs(self) -> None:
        """One ``syncfs`` per filesystem holding a folder whose chunks were not synced."""
        devices: set[int] = set()
        for root, each in zip(self._folder.roots, self.each_chunk, strict=True):
            device = os.stat(root).st_dev
            if not each and device not in devices:
                devices.add(device)
                journal.syncfs(root)

    def _parallel(self, fn: Callable[[Path], None], paths: list[Path]) -> None:
        if paths:
            gather([self._engine.submit(fn, path) for path in paths]).result()


class Committer:
    """Applies the commits of one store (the caller holds the store's gate exclusively).

    :attr:`broken` is set when a durable commit failed after its commit point: the journal on
    disk is then the truth, not the index in memory, and the store must be reopened (which
    rolls that commit forward).
    """

    def __init__(
        self,
        folder: StoreFolder,
        targets: ChunkTargets,
        sync: SyncPolicy,
        *,
        durable: bool,
    ) -> None:
        self._folder, self._targets, self._sync = folder, targets, sync
        self._durable = durable
        self.broken: str | None = None

    def commit(self, index: StoreIndex, generation: int, meta: dict[str, Any]) -> None:
        """Make ``index``'s current state generation ``generation`` with ``meta``, atomically
        (durable) or in place (scratch); on success the index reads as committed."""
        current = index.current()
        plan, documents = plan_changes(
            index.committed,
            current,
            index.changed_files(),
            generation=generation,
            meta=meta,
            durable=self._durable,
            purged={key: self._folder.files_of(key) for key in index.purged()},
            new_spare=self._targets.spare_namer(),
        )
        self._apply(plan, documents)
        self._targets.adopt(spare for _final, spare in plan.recycle)
        index.mark_committed(current)
        self._targets.fit_spares(index.spare_room())

    def _apply(self, plan: journal.CommitPlan, documents: list[tuple[str, bytes]]) -> None:
        root, roots = self._folder.root, self._folder.roots
        try:
            if self._durable:
                journal.commit_durable(
                    roots,
                    self._folder.staging,
                    plan,
                    documents,
                    sync_files=self._sync.files,
                    sync_dirs=self._sync.dirs,
                )
            else:
                journal.apply_in_place(roots, plan, documents)
        except BaseException as exc:
            if self._durable and (self._folder.internal / journal.JOURNAL).exists():
                # Past the commit point: the journal is the truth, this object's view is not.
                self.broken = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OSError):
                raise translate_os_error(exc, f"committing store {str(root)!r}") from exc
            raise
