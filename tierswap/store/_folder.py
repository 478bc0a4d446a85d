"""The store's folders as one: creating them, the writer locks, crash recovery and loading.

Opening a store for writing takes an exclusive ``flock`` on the private ``.tierswap`` folder of
each of its folders, rolls forward a commit whose journal (in the home) survived a crash,
discards uncommitted staged files and reads every array's metadata. Readers take no lock; if
they find a journal (a writer is in the middle of a commit, or crashed there) they read through
it, so they also see the last commit. Each folder on its own (marker, lock) is
:class:`~tierswap.store._members.Folder`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError, CorruptionError
from tierswap.store import _journal as journal
from tierswap.store._layout import (
    INTERNAL_DIR,
    NESTED_PREFIX,
    ArrayMeta,
    locate,
    parse_array_document,
    parse_root_document,
    qualify,
    root_document,
)
from tierswap.store._members import (
    Folder,
    check_apart_folders,
    discover,
    marker_tags,
    new_store_id,
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
    """Paths, locks and recovery of one store's folders (the home first).

    ``paths`` is the store's folder, or its folders; the home of a store on several folders
    given alone stands for all of them (its marker lists them), once :meth:`open_writer` or
    :meth:`check_readable` ran.
    """

    def __init__(self, paths: Path | Sequence[Path]) -> None:
        self._use([paths] if isinstance(paths, Path) else list(paths))

    def _use(self, roots: list[Path]) -> None:
        if not roots:
            raise ConfigError("a store needs at least one folder; pass a path or a list of paths")
        known: dict[Path, Folder] = {}  # keep the objects holding locks
        for folder in getattr(self, "folders", []):
            known.setdefault(folder.root, folder)
        self.roots = roots
        self.folders = [known.get(root) or Folder(root) for root in roots]
        self.home = self.folders[0]
        self.root, self.internal, self.staging = (
            self.home.root,
            self.home.internal,
            self.home.staging,
        )

    @staticmethod
    def discover(paths: Path | Sequence[Path]) -> list[Path]:
        """Every folder of the store at ``paths`` (:func:`~tierswap.store._members.discover`)."""
        return discover([paths] if isinstance(paths, Path) else list(paths))

    # ------------------------------------------------------------------ writer side
    def open_writer(
        self, *, wipe: bool, durable: bool, sync_dirs: Callable[[Iterable[Path]], None]
    ) -> None:
        """Create, lock and recover the folders for a writer."""
        check_apart_folders(self.roots)
        self.home.prepare()
        self.home.lock()
        try:
            marker = self.home.marker()
            if not wipe:  # (mode "w" makes any store folder a new store's)
                _check_home(self.root, marker)
                self._use(discover(self.roots))
            check_apart_folders(self.roots)
            for folder in self.folders[1:]:  # a writer elsewhere: StoreLockedError first
                if folder.internal.is_dir():
                    folder.lock()
            store_id = self._check_members(marker, wipe=wipe)
            for folder in self.folders[1:]:
                folder.prepare()
                if not folder.locked:
                    folder.lock()
            if wipe:
                for folder in self.folders:
                    folder.wipe()
                self._drop_unlisted_nested()
            plan = journal.read_journal(self.internal)
            if plan is not None:  # the commit point was passed: finish that commit
                journal.roll_forward(self.roots, self.internal, plan, sync_dirs)
            for folder in self.folders:
                shutil.rmtree(folder.staging, ignore_errors=True)
            self._initialise(durable, store_id)
        except BaseException:
            self.unlock()
            raise

    def _drop_unlisted_nested(self) -> None:
        """Remove folders nested in the home's private folder (a snapshot's) that are not
        folders of the store any more."""
        for nested in self.internal.glob(f"{NESTED_PREFIX}*"):
            if nested not in self.roots:
                shutil.rmtree(nested, ignore_errors=True)

    def _check_members(self, marker: dict[str, Any] | None, *, wipe: bool) -> str | None:
        """The id of the store the folders make (``None``: one folder); raises ConfigError
        when they are not one store's, or a new store's folder is not empty."""
        known = (marker or {}).get("store")
        if known is not None and not wipe:
            self._check_listed(marker or {}, known)
            return str(known)
        if len(self.roots) == 1:
            return None
        for folder in self.folders[1:]:
            if not wipe and not folder.blank():
                raise ConfigError(
                    f"folder {str(folder.root)!r} is not empty; a new store needs empty "
                    "folders (or open with mode='w' to wipe a store's folders)"
                )
        return new_store_id()

    def _check_listed(self, marker: dict[str, Any], store_id: str) -> None:
        """Raise ConfigError unless the folders are those of store ``store_id``, in order."""
        listed = marker.get("folders") or []
        if len(listed) != len(self.roots):
            raise ConfigError(
                f"store {str(self.root)!r} spans {len(listed)} folders ({listed}) but "
                f"{len(self.roots)} were given; open it with all of its folders, in order"
            )
        for index, folder in enumerate(self.folders[1:], start=1):
            _check_member(folder, store_id, index, self.root)

    def _initialise(self, durable: bool, store_id: str | None) -> None:
        if not (self.root / "zarr.json").exists():
            doc = root_document(0, {}, durable)
            journal.atomic_write_bytes(self.root / "zarr.json", json.dumps(doc).encode())
        if store_id is None:
            self.home.write_marker({"internal": True})
            return
        tags = marker_tags(self.roots, store_id)
        order = [*zip(self.folders[1:], tags[1:], strict=True), (self.home, tags[0])]
        for folder, tag in order:  # the home's marker last
            folder.write_marker(tag)

    def unlock(self) -> None:
        for folder in self.folders:
            folder.unlock()

    def lock(self) -> None:
        """Lock every folder (a writer's exclusive lock); raises StoreLockedError."""
        try:
            for folder in self.folders:
                folder.lock()
        except BaseException:
            self.unlock()
            raise

    # ------------------------------------------------------------------ both sides
    def check_readable(self) -> None:
        """Find the store's folders for a reader; raises ConfigError when they are not one."""
        marker = self.home.marker() or {}
        _check_home(self.root, marker)
        if not (self.root / "zarr.json").exists():
            raise ConfigError(f"no store at {str(self.root)!r} (no zarr.json); check the path")
        self._use(discover(self.roots))
        check_apart_folders(self.roots)
        known = marker.get("store")
        if known is not None:
            self._check_listed(marker, str(known))
        elif len(self.roots) > 1:
            home = str(self.root)
            raise ConfigError(f"store {home!r} is on one folder; open it as SwapStore({home!r})")

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
        sources = ((locate(self.roots, s), d) for s, d in plan.moves)
        return {d: src for src, d in sources if src.exists()}, set(plan.unlinks)

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
        metadata is damaged, whatever chunk files its folders hold), by qualified path
        (:func:`~tierswap.store._layout.qualify`). Never the journal, the staging folders, the
        lock, nor the markers of a store on several folders (a snapshot writes its own).
        """
        redirect, removed = self._journal_view()
        index = self._load(redirect, removed)
        files = {"zarr.json": redirect.get("zarr.json", self.root / "zarr.json")}
        if len(self.roots) == 1 and (self.internal / "zarr.json").exists():
            files[f"{INTERNAL_DIR}/zarr.json"] = self.internal / "zarr.json"
        for rel in self._metadata_files(redirect) - removed:
            files[rel] = redirect.get(rel, self.root / rel)
        for meta, paths in index.arrays.values():
            files.update(
                (meta.chunk_qualified(i), path) for i, path in enumerate(paths[: meta.nchunks])
            )
        for key in index.damaged:
            files.update((rel, locate(self.roots, rel)) for rel in self.files_of(key))
        return index.generation, files

    def _load_array(self, index: Index, rel: str, redirect: dict[str, Path]) -> None:
        key = rel.removesuffix("/zarr.json")
        try:
            doc = self._read_doc(rel, redirect)
            if not isinstance(doc, dict) or doc.get("node_type") != "array":
                return
            meta = parse_array_document(key, doc)
            rels = [meta.chunk_qualified(i) for i in range(meta.nchunks)]
            paths = [redirect.get(r) or locate(self.roots, r) for r in rels]
        except CorruptionError as exc:
            index.damaged[key] = str(exc)
            return
        index.arrays[key] = (meta, paths)

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
        """Qualified paths of the metadata and chunk files on disk under ``key``'s folder
        (in every folder of the store)."""
        found = [f"{key}/zarr.json"]
        for index, root in enumerate(self.roots):
            chunks = root / key / "c"
            names = sorted(p.name for p in chunks.iterdir()) if chunks.is_dir() else []
            found += [qualify(index, f"{key}/c/{name}") for name in names]
        return found

    def folder_of(self, path: Path) -> int:
        """The index of the folder holding ``path`` (the innermost one: folders may nest in
        the home's private folder)."""
        inside = [i for i, root in enumerate(self.roots) if path.is_relative_to(root)]
        if not inside:
            raise ValueError(f"{str(path)!r} is in none of the store's folders")
        return max(inside, key=lambda i: len(self.roots[i].parts))

    def qualified(self, path: Path) -> str:
        """The qualified path (:func:`~tierswap.store._layout.qualify`) of ``path``."""
        index = self.folder_of(path)
        return qualify(index, str(path.relative_to(self.roots[index])))

    def disk_usage(self, index: int | None = None) -> int:
        """Bytes the store's files occupy on disk (allocated blocks, like ``du``), in every
        folder or in folder ``index``."""
        roots = self.roots if index is None else [self.roots[index]]
        return sum(_usage(root, set(self.roots) - {root}) for root in roots)


def _usage(root: Path, skip: set[Path]) -> int:
    """Allocated bytes of the files under ``root``, leaving out the folders ``skip``."""
    total = 0
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(dirpath, d) not in skip]
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # a writer replaced it meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _check_home(root: Path, marker: dict[str, Any] | None) -> None:
    """Raise ConfigError when ``root`` is another folder than the home of its store."""
    index = (marker or {}).get("folder", 0)
    if index != 0:
        home = (marker or {}).get("home")
        raise ConfigError(
            f"{str(root)!r} is folder {index} of the store whose home is {home!r}; open the "
            "store through its home folder (or all its folders in order, the home first)"
        )


def _check_member(folder: Folder, store_id: str, index: int, home: Path) -> None:
    """Raise ConfigError unless ``folder`` is folder ``index`` of store ``store_id``."""
    where = f"folder {index} of the store at {str(home)!r}"
    if not folder.root.is_dir():
        raise ConfigError(
            f"{where}, {str(folder.root)!r}, is missing; mount its drive, or open the store "
            "with the list of its folders where they are now"
        )
    marker = folder.marker() or {}
    if marker.get("store") != store_id:
        raise ConfigError(
            f"{str(folder.root)!r} holds no part of the store at {str(home)!r} (it should be "
            f"{where}): is its drive mounted? Pass the store's folders in their order"
        )
    if marker.get("folder") != index:
        raise ConfigError(
            f"{str(folder.root)!r} is folder {marker.get('folder')} of the store at "
            f"{str(home)!r}, not folder {index}; pass the store's folders in their order"
        )
