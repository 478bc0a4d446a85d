"""Whole-tensor writes: a put's chunk files written in parallel, then installed as the key.

A put writes every chunk of a tensor into new files (durable stores: staged files, or recycled
spares, that the next commit makes current; scratch stores: files renamed over the old chunks
once all are written), each with its CRC32C. Only when all of them are written does the key
change, in the index, under the gate's lock; a write that fails deletes its files and leaves
the key as it was. :meth:`WholeWrites.install_all` does the same for several keys at once,
all or none (``put_many``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from tierswap.io import gather, translate_os_error
from tierswap.store._chunks import ChunkFiles, ChunkTarget
from tierswap.store._gate import Gate
from tierswap.store._index import StoreIndex
from tierswap.store._layout import ArrayMeta, locate
from tierswap.store._staging import ChunkTargets, unlink_all
from tierswap.store._tensors import flat_bytes

__all__ = ["WholeWrites", "Written"]

#: A whole-tensor write that ended: the metadata with its CRCs, and the chunk files written.
Written = tuple[ArrayMeta, list[Path]]


class WholeWrites:
    """Writes and installs whole tensors of one store (its folders ``paths``, home first).

    The caller holds a shared section of ``gate`` with the key's put claim from
    :meth:`submit` until the write is installed; this class takes the gate's lock only to
    change ``index``.
    """

    def __init__(
        self,
        gate: Gate,
        index: StoreIndex,
        chunks: ChunkFiles,
        targets: ChunkTargets,
        *,
        durable: bool,
        paths: Sequence[Path],
    ) -> None:
        self._gate = gate
        self._index = index
        self._chunks = chunks
        self._targets = targets
        self._durable = durable
        self._paths = tuple(paths)

    def submit(self, meta: ArrayMeta, source: torch.Tensor | None) -> Future[Written]:
        """Start writing ``meta``'s chunk files from ``source`` (``None``: sparse zeros); the
        future holds the metadata with its CRCs and the files, which a failure deletes."""
        batch, chunks, size = self._targets.batch(), self._chunks, meta.chunk_bytes
        paths: list[Path] = []
        futures: list[Future[int]] = []
        try:
            flat = flat_bytes(source) if source is not None else None
            for i in range(meta.nchunks):
                offset, length = meta.payload(i)
                folder = meta.folder_of(i)
                if flat is None:
                    paths.append(self._targets.new_path(meta.key, batch, i, folder))
                    target = ChunkTarget(meta.key, i, paths[-1], folder)
                    futures.append(chunks.submit(folder, chunks.zero, target, length, size))
                    continue
                path, recycled = self._targets.write_target(meta, batch, i)
                paths.append(path)
                target = ChunkTarget(meta.key, i, path, folder, in_place=recycled)
                piece = flat[offset : offset + length]
                futures.append(chunks.submit(folder, chunks.write, target, piece, size))
        except BaseException as exc:  # failed to start: undone once the started writes end
            failed: Future[int] = Future()
            failed.set_exception(exc)
            futures.append(failed)
        written: Future[Written] = Future()

        def _done(done: Future[list[int]], source: torch.Tensor | None = source) -> None:
            del source  # kept alive until the writes finished
            error = done.exception()
            if error is None:
                written.set_result((dataclasses.replace(meta, crcs=tuple(done.result())), paths))
            else:
                try:  # a failed cleanup must not leave the caller waiting
                    unlink_all(paths)
                finally:
                    written.set_exception(error)

        gather(futures).add_done_callback(_done)
        return written

    def install_written(self, done: Future[Written]) -> None:
        """Install one finished put's files (deleting them if that fails); raises its error."""
        meta, paths = done.result()
        try:
            self._install(meta, paths)
        except OSError as exc:
            unlink_all(paths)
            translated = translate_os_error(exc, f"installing key {meta.key!r}")
            if translated is exc:
                raise
            raise translated from exc

    def install_all(self, writes: list[Future[Written]]) -> None:
        """Install the writes of ``put_many`` once all ended, or none (deleting them)."""
        written, error = [], None
        for future in writes:
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
        if error is not None:
            unlink_all(path for _meta, paths in written for path in paths)
            raise error

    def damage(self, key: str, why: str) -> None:
        """Report ``key`` as damaged (a scratch store's in-place change failed midway): reads
        raise, ``verify`` lists it, a put or delete repairs it. Its files stay as they are
        until then (the next commit leaves them alone, so a reopen finds the damage)."""
        with self._gate.locked():
            entry = self._index.damage(key, why)
            doomed = self._index.retire(entry) if entry is not None else []
        self._targets.discard(doomed)

    def _install(self, meta: ArrayMeta, paths: list[Path]) -> None:
        """Make freshly written chunk files the current version of ``meta.key``."""
        if not self._durable:  # scratch: rename over the old chunks, drop any extra ones
            paths = self._replace_in_place(meta, paths)
        with self._gate.locked():
            old = self._index.install(meta, paths, staged=self._durable)
            doomed = self._index.retire(old) if old is not None else []
            room = self._index.spare_room()  # a new key's rewrites are recycled too
        self._targets.fit_spares(room)
        self._targets.discard(doomed)

    def _replace_in_place(self, meta: ArrayMeta, paths: list[Path]) -> list[Path]:
        """A scratch put's renames over the chunk files of ``meta.key``; returns the final
        paths (old chunk files that are not among them are deleted)."""
        finals = [locate(self._paths, meta.chunk_qualified(i)) for i in range(len(paths))]
        for i, (path, final) in enumerate(zip(paths, finals, strict=True)):
            try:
                os.replace(path, final)
            except OSError as exc:
                if i:  # old and new chunk files mixed: neither version is there
                    self.damage(meta.key, f"a put failed midway through its renames: {exc}")
                raise
        with self._gate.locked():
            old = self._index.find(meta.key)
        for extra in set(old.files) - set(finals) if old else ():
            with contextlib.suppress(FileNotFoundError):
                extra.unlink()
        return finals
