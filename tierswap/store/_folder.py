"""The store's folder: creating it, the writer lock, crash recovery and loading the index.

Opening a store for writing takes an exclusive ``flock`` on the private ``.tierswap`` folder,
rolls forward a commit whose journal survived a crash, discards uncommitted staged files and
reads every array's metadata. Readers take no lock; if they find a journal (a writer is in the
middle of a commit, or crashed there) they read through it, so they also see the last commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError, CorruptionError, StoreLockedError
from tierswap.store import _journal as journal
from tierswap.store._layout import (
    INTERNAL_DIR,
    ArrayMeta,
    chunk_relpath,
    group_document,
    parse_array_document,
    parse_root_document,
    root_document,
)

__all__ = ["Index", "StoreFolder"]


@dataclasses.dataclass
class Index:
    """What a store folder holds at its last commit."""

    generation: int
    meta: dict[str, Any]
    arrays: dict[str, tuple[ArrayMeta, list[Path]]]  # key -> (metadata, chunk file paths)
    damaged: dict[str, str]  # key -> why its metadata cannot be read
    durable: bool = True  # the mode of the writer that made the last commit


class StoreFolder:
    """Paths, lock and recovery of one store folder."""

    def __init__(self, path: Path) -> None:
        self.root = path
        self.internal = path / INTERNAL_DIR
        self.staging = self.internal / journal.STAGING
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ writer side
    def open_writer(
        self, *, wipe: bool, durable: bool, sync_dirs: Callable[[Iterable[Path]], None]
    ) -> None:
        """Create, lock and recover the folder for a writer."""
        self._prepare()
        self.lock()
        try:
            if wipe:
                self._wipe()
            plan = journal.read_journal(self.internal)
            if plan is not None:  # the commit point was passed: finish that commit
                journal.roll_forward(self.root, self.internal, plan, sync_dirs)
            shutil.rmtree(self.staging, ignore_errors=True)
            self._initialise(durable)
        except BaseException:
            self.unlock()
            raise

    def _prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"store path {str(self.root)!r} is a file; pass a folder")
        is_store = (self.root / "zarr.json").exists() or self.internal.exists()
        if self.root.exists() and not is_store and any(self.root.iterdir()):
            raise ConfigError(
                f"folder {str(self.root)!r} is not empty and holds no store; pick an empty folder"
            )
        self.internal.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        fd = os.open(self.internal, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise StoreLockedError(
                f"store {str(self.root)!r} is open for writing elsewhere; close that writer, "
                "or open with mode='r' to read"
            ) from exc
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _wipe(self) -> None:
        for child in self.root.iterdir():
            if child.name == INTERNAL_DIR:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.internal / journal.JOURNAL).unlink()

    def _initialise(self, durable: bool) -> None:
        internal_doc = self.internal / "zarr.json"
        if not internal_doc.exists():
            doc = group_document({"tierswap": {"internal": True}})
            journal.atomic_write_bytes(internal_doc, json.dumps(doc).encode())
        if not (self.root / "zarr.json").exists():
            doc = root_document(0, {}, durable)
            journal.atomic_write_bytes(self.root / "zarr.json", json.dumps(doc).encode())

    # ------------------------------------------------------------------ both sides
    def check_readable(self) -> None:
        if not (self.root / "zarr.json").exists():
            raise ConfigError(f"no store at {str(self.root)!r} (no zarr.json); check the path")

    def load(self, *, through_journal: bool) -> Index:
        """Read the committed index; a reader passes ``through_journal`` to see a commit that
        a writer has made but not yet rolled forward."""
        redirect, removed = self._journal_view() if through_journal else ({}, set())
        return self._load(redirect, removed)

    def _journal_view(self) -> tuple[dict[str, Path], set[str]]:
        """(final relpath -> staged file not yet moved there, relpaths the commit removes)."""
        plan = journal.read_journal(self.internal)
        if plan is None:
            return {}, set()
        redirect = {d: self.root / s for s, d in plan.moves if (self.root / s).exists()}
        return redirect, set(plan.unlinks)

    def _load(self, redirect: dict[str, Path], removed: set[str]) -> Index:
        generation, meta, durable = parse_root_document(self._read_doc("zarr.json", redirect))
        index = Index(generation, meta, {}, {}, durable)
        for rel in sorted(self._metadata_files(redirect) - removed):
            self._load_array(index, rel, redirect)
        return index

    def committed_files(self) -> tuple[int, dict[str, Path]]:
        """The last commit as files: ``(generation, {relpath in the store: file holding it})``.

        Read through a pending journal, like a reader. Lists the root and internal group
        documents, every node's ``zarr.json`` and every array's chunk files (for an array whose
        metadata is damaged, whatever chunk files its folder holds). Never the journal, the
        staging folder or the lock.
        """
        redirect, removed = self._journal_view()
        index = self._load(redirect, removed)
        files = {"zarr.json": redirect.get("zarr.json", self.root / "zarr.json")}
        if (self.internal / "zarr.json").exists():
            files[f"{INTERNAL_DIR}/zarr.json"] = self.internal / "zarr.json"
        for rel in self._metadata_files(redirect) - removed:
            files[rel] = redirect.get(rel, self.root / rel)
        for key, (meta, paths) in index.arrays.items():
            files.update(
                (chunk_relpath(key, i), path) for i, path in enumerate(paths[: meta.nchunks])
            )
        for key in index.damaged:
            files.update((rel, self.root / rel) for rel in self.files_of(key))
        return index.generation, files

    def _load_array(self, index: Index, rel: str, redirect: dict[str, Path]) -> None:
        key = rel.removesuffix("/zarr.json")
        try:
            doc = self._read_doc(rel, redirect)
            if not isinstance(doc, dict) or doc.get("node_type") != "array":
                return
            meta = parse_array_document(key, doc)
        except CorruptionError as exc:
            index.damaged[key] = str(exc)
            return
        rels = [chunk_relpath(key, i) for i in range(meta.nchunks)]
        index.arrays[key] = (meta, [redirect.get(r, self.root / r) for r in rels])

    def _read_doc(self, rel: str, redirect: dict[str, Path]) -> Any:
        path = redirect.get(rel, self.root / rel)
        try:
            return json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise CorruptionError(f"metadata file {str(path)!r} is unreadable: {exc}") from exc

    def _metadata_files(self, redirect: dict[str, Path]) -> set[str]:
        """Relpaths of every node's ``zarr.json`` below the root (the root's own excluded)."""
        found = {rel for rel in redirect if rel.endswith("/zarr.json")}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d != INTERNAL_DIR]
            elif "zarr.json" in filenames:
                found.add(f"{rel_dir}/zarr.json")
        return found

    def files_of(self, key: str) -> list[str]:
        """Relpaths of the metadata and chunk files on disk under ``key``'s folder."""
        chunks = self.root / key / "c"
        names = sorted(p.name for p in chunks.iterdir()) if chunks.is_dir() else []
        return [f"{key}/zarr.json", *(f"{key}/c/{name}" for name in names)]

    def disk_usage(self) -> int:
        """Bytes the folder's files occupy on disk (allocated blocks, like ``du``)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(FileNotFoundError):  # a writer replaced it meanwhile
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total
