"""Where a store's new chunk files go, and what becomes of the files they supersede.

A durable store writes every new chunk version to a fresh file in its staging folder (recycled
from a spare of the same size where one is free, see :mod:`tierswap.store._recycle`), which a
commit renames into place; a scratch store writes beside the chunk file and renames over it at
once. Staged files that nothing needs any more are kept as spares (durable stores) or deleted.
Every file is written in the folder its chunk lives in (:meth:`ArrayMeta.folder_of
<tierswap.store._layout.ArrayMeta.folder_of>`): its own staging folder and spare pool.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tierswap.store._folder import StoreFolder
from tierswap.store._journal import mkdirs_durable
from tierswap.store._layout import ArrayMeta, chunk_relpath, split_qualified
from tierswap.store._recycle import SparePool

__all__ = ["ChunkTargets", "unlink_all"]


class ChunkTargets:
    """New chunk files and superseded ones of one store.

    Parameters
    ----------
    folder:
        The store's folders (roots and staging folders).
    durable:
        Stage new files (``True``) or write them beside the chunk they replace.
    spares:
        The writer's spare pools, one per folder; ``None`` for a reader.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self, folder: StoreFolder, *, durable: bool, spares: list[SparePool] | None
    ) -> None:
        self._folder = folder
        self._durable = durable
        self._spares = spares  # one pool per folder, in the order of the store's folders
        self._batches = itertools.count()
        # staging folders made durable by this object: they stay until the store closes
        # (commits leave them), so a write's new file costs no stat of its folder
        self._staging_ready: set[int] = set()

    def batch(self) -> int:
        """A fresh number naming the files of one write (unique within this store object)."""
        return next(self._batches)

    def new_path(self, key: str, batch: int, index: int, folder: int = 0) -> Path:
        """A new file in folder ``folder`` for chunk ``index`` of ``key``, written by write
        number ``batch``."""
        if self._durable:
            staging = self._folder.folders[folder].staging
            if folder not in self._staging_ready:
                mkdirs_durable(staging)  # its entry durable before a journal names files in it
                self._staging_ready.add(folder)
            return staging / f"{batch}.{index}"
        final = self._folder.roots[folder] / chunk_relpath(key, index)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f"{index}.{batch}.partial")

    def write_target(self, meta: ArrayMeta, batch: int, index: int) -> tuple[Path, bool]:
        """Where a durable write of chunk ``index`` goes: a staging file, recycled from a spare
        when one of the size is free (whole chunks only: a spare's bytes past a shorter
        payload would not be zeros); returns the path and whether it was recycled."""
        folder = meta.folder_of(index)
        path = self.new_path(meta.key, batch, index, folder)
        _offset, length = meta.payload(index)
        if self._durable and self._spares is not None and length == meta.chunk_bytes:
            return path, self._spares[folder].take(meta.chunk_bytes, path)
        return path, False

    def discard(self, paths: list[Path]) -> None:
        """Superseded staged files: kept as spares (durable stores), else deleted."""
        if self._spares is None or not self._durable:
            unlink_all(paths)
            return
        for path in paths:
            self._spares[self._folder.folder_of(path)].keep([path])

    # ------------------------------------------------------------------ commits
    def spare_namer(self) -> Callable[[], str] | None:
        """Names (paths inside a folder) for the committed chunks a commit keeps as spares;
        ``None`` when this store keeps none (a scratch store or a reader)."""
        if self._spares is None or not self._durable:
            return None
        home_spares, home = self._spares[0], self._folder.root
        return lambda: str(home_spares.new_path().relative_to(home))

    def adopt(self, relpaths: Iterable[str]) -> None:
        """Take the spares a commit has moved into the pools (qualified paths, see
        :meth:`spare_namer`)."""
        if self._spares is not None:
            for qualified in relpaths:
                folder, rel = split_qualified(qualified)
                self._spares[folder].adopt([self._folder.roots[folder] / rel])

    def fit_spares(self, room: Sequence[int]) -> None:
        """Let each folder's spare pool hold ``room[folder]`` bytes
        (:meth:`~tierswap.store._index.StoreIndex.spare_room`)."""
        if self._spares is None:
            return
        for pool, cap in zip(self._spares, room, strict=True):
            pool.cap = cap

    def clear(self) -> None:
        """Delete every spare (the store closes)."""
        for pool in self._spares or []:
            pool.clear()


def unlink_all(paths: Iterable[Path]) -> None:
    """Delete ``paths`` that exist: the cleanup of a write that failed or was undone."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            path.unlink()
