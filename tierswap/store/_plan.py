"""Turn "what was committed" and "what is current" into the commit plan of one commit.

Pure functions: no I/O, so the commit logic can be tested on its own. The journal module applies
the plan crash-safely (:func:`tierswap.store._journal.commit_durable`). Paths are qualified
(:func:`tierswap.store._layout.qualify`): a chunk in another folder than the home is named with
its folder, and the documents all live in the home.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tierswap.store._journal import CommitPlan
from tierswap.store._layout import (
    ArrayMeta,
    array_document,
    group_document,
    qualify,
    root_document,
    split_qualified,
)

__all__ = ["Documents", "plan_changes"]

#: The metadata documents of a commit: ``(final relpath, encoded zarr.json)``.
Documents = list[tuple[str, bytes]]


def _groups(keys: Iterable[str]) -> set[str]:
    """Every proper prefix of every key: the zarr groups the hierarchy needs."""
    groups: set[str] = set()
    for key in keys:
        parts = key.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return groups


def _depth_first(paths: Iterable[str]) -> list[str]:
    return sorted(set(paths), key=lambda p: (-p.count("/"), p))


def _key_dirs(key: str, folders: Iterable[int]) -> list[str]:
    """The folders a removed key leaves behind: its own two in the home, and in each other
    folder of ``folders`` also its groups' (removed only once empty)."""
    dirs = [f"{key}/c", key]
    parts = key.split("/")
    for folder in set(folders) - {0}:
        dirs += [qualify(folder, f"{key}/c"), qualify(folder, key)]
        dirs += [qualify(folder, "/".join(parts[:i])) for i in range(1, len(parts))]
    return dirs


def plan_changes(
    committed: Mapping[str, ArrayMeta],
    current: Mapping[str, ArrayMeta],
    changed: Mapping[str, list[str | None]],
    *,
    generation: int,
    meta: dict[str, Any],
    durable: bool,
    purged: Mapping[str, list[str]] | None = None,
    new_spare: Callable[[], str] | None = None,
) -> tuple[CommitPlan, Documents]:
    """Plan the commit from ``committed`` to ``current``: the journal's plan and the documents
    to write.

    ``changed`` maps each key whose data or metadata changed to the relpaths of its staged
    chunk files, by chunk index (``None`` for a chunk already in place: not rewritten since the
    last commit, or written in place as in scratch mode; an empty list when none is staged).
    ``purged`` maps deleted keys whose metadata was unreadable to the relpaths of their files.
    ``new_spare`` names a fresh spare file (a path inside a folder, qualified here with the
    chunk's folder): with it, every committed whole chunk that a staged one replaces in the
    same folder is moved there (``plan.recycle``) instead of being dropped.
    """
    documents: list[tuple[str, dict[str, Any]]] = []
    moves: list[tuple[str, str]] = []
    recycle: list[tuple[str, str]] = []
    unlinks: list[str] = []
    rmdirs: list[str] = []
    for key, staged in changed.items():
        new, old = current[key], committed.get(key)
        documents.append((f"{key}/zarr.json", array_document(new)))
        key_moves, key_recycle, moved_away = _chunk_moves(staged, old, new, new_spare)
        moves += key_moves
        recycle += key_recycle
        unlinks += moved_away
        if old is not None:
            unlinks += [old.chunk_qualified(i) for i in range(new.nchunks, old.nchunks)]
    for key in committed.keys() - current.keys():
        old = committed[key]
        unlinks += [old.chunk_qualified(i) for i in range(old.nchunks)]
        unlinks.append(f"{key}/zarr.json")
        rmdirs += _key_dirs(key, old.folders)
    for key, files in (purged or {}).items():
        unlinks += files
        rmdirs += _key_dirs(key, (split_qualified(f)[0] for f in files))
    needed, before = _groups(current), _groups(committed)
    documents += [(f"{g}/zarr.json", group_document()) for g in sorted(needed - before)]
    for group in before - needed:
        unlinks.append(f"{group}/zarr.json")
        rmdirs.append(group)
    documents.append(("zarr.json", root_document(generation, meta, durable)))
    targets = {dst for _, dst in moves} | {path for path, _ in documents}
    unlinks = [p for p in unlinks if p not in targets]
    plan = CommitPlan(
        generation, tuple(moves), tuple(unlinks), tuple(_depth_first(rmdirs)), tuple(recycle)
    )
    return plan, [(rel, json.dumps(doc).encode()) for rel, doc in documents]


def _chunk_moves(
    staged: list[str | None],
    old: ArrayMeta | None,
    new: ArrayMeta,
    new_spare: Callable[[], str] | None,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """The moves of a key's staged chunks, (with ``new_spare``) the spares the whole committed
    chunks they replace become, and the committed chunks that a staged one replaces from
    another folder (to unlink)."""
    moves: list[tuple[str, str]] = []
    recycle: list[tuple[str, str]] = []
    moved_away: list[str] = []
    for i, src in enumerate(staged):
        if src is None:
            continue
        final = new.chunk_qualified(i)
        moves.append((src, final))
        if old is not None and i < old.nchunks and old.folder_of(i) != new.folder_of(i):
            moved_away.append(old.chunk_qualified(i))
        elif new_spare is not None and _whole_chunk(old, i):
            recycle.append((final, qualify(new.folder_of(i), new_spare())))
    return moves, recycle, moved_away


def _whole_chunk(old: ArrayMeta | None, index: int) -> bool:
    """Whether the last commit holds chunk ``index`` of ``old`` as a whole (unpadded) chunk."""
    return old is not None and index < old.nchunks and old.payload(index)[1] == old.chunk_bytes
