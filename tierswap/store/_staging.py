"""Where a store's new chunk files go, and what becomes of the files they supersede.

A durable store writes every new chunk version to a fresh file in its staging folder (recycled
from a spare of the same size where one is free, see :mod:`tierswap.store._recycle`), which a
commit renames into place; a scratch store writes beside the chunk file and renames over it at
once. Staged files that nothing needs any more are kept as spares (durable stores) or deleted.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from tierswap.store._folder import StoreFolder
from tierswap.store._layout import ArrayMeta, chunk_relpath
from tierswap.store._recycle import SparePool

__all__ = ["ChunkTargets", "unlink_all"]


class ChunkTargets:
    """New chunk files and superseded ones of one store.

    Parameters
    ----------
    folder:
        The store's folder (root and staging folder).
    durable:
        Stage new files (``True``) or write them beside the chunk they replace.
    spares:
        The writer's spare pool, ``None`` for a reader.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, folder: StoreFolder, *, durable: bool, spares: SparePool | None) -> None:
        self._root, self._staging = folder.root, folder.staging
        self._durable = durable
        self._spares = spares
        self._batches = itertools.count()

    def batch(self) -> int:
        """A fresh number naming the files of one write (unique within this store object)."""
        return next(self._batches)

    def new_path(self, key: str, batch: int, index: int) -> Path:
        """A new file for chunk ``index`` of ``key``, written by write number ``batch``."""
        if self._durable:
            self._staging.mkdir(exist_ok=True)
            return self._staging / f"{batch}.{index}"
        final = self._root / chunk_relpath(key, index)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f"{index}.{batch}.partial")

    def write_target(self, meta: ArrayMeta, batch: int, index: int) -> tuple[Path, bool]:
        """Where a durable write of chunk ``index`` goes: a staging file, recycled from a spare
        when one of the size is free (whole chunks only: a spare's bytes past a shorter
        payload would not be zeros); returns the path and whether it was recycled."""
        path = self.new_path(meta.key, batch, index)
        _offset, length = meta.payload(index)
        if self._durable and self._spares is not None and length == meta.chunk_bytes:
            return path, self._spares.take(meta.chunk_bytes, path)
        return path, False

    def discard(self, paths: list[Path]) -> None:
        """Superseded staged files: kept as spares (durable stores), else deleted."""
        if self._spares is not None and self._durable:
            self._spares.keep(paths)
        else:
            unlink_all(paths)

    # ------------------------------------------------------------------ commits
    def spare_namer(self) -> Callable[[], str] | None:
        """Names (relpaths) for the committed chunks a commit keeps as spares; ``None`` when
        this store keeps none (a scratch store or a reader)."""
        if self._spares is None or not self._durable:
            return None
        spares, root = self._spares, self._root
        return lambda: str(spares.new_path().relative_to(root))

    def adopt(self, relpaths: Iterable[str]) -> None:
        """Take the spares a commit has moved into the pool (see :meth:`spare_namer`)."""
        if self._spares is not None:
            self._spares.adopt(self._root / rel for rel in relpaths)

    def fit_spares(self, committed: Mapping[str, ArrayMeta]) -> None:
        """Spares may hold as many bytes as the committed chunks: disk use stays within 2x."""
        if self._spares is not None:
            self._spares.cap = sum(m.nchunks * m.chunk_bytes for m in committed.values())

    def clear(self) -> None:
        """Delete every spare (the store closes)."""
        if self._spares is not None:
            self._spares.clear()


def unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
