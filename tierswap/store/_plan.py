"""Turn "what was committed" and "what is current" into the commit plan of one commit.

Pure functions: no I/O, so the commit logic can be tested on its own. The journal module applies
the plan crash-safely (:func:`tierswap.store._journal.commit_durable`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tierswap.store._journal import CommitPlan
from tierswap.store._layout import (
    ArrayMeta,
    array_document,
    chunk_relpath,
    group_document,
    root_document,
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
    return sorted(paths, key=lambda p: (-p.count("/"), p))


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
    ``new_spare`` names a fresh spare file (a relpath): with it, every committed whole chunk
    that a staged one replaces is moved there (``plan.recycle``) instead of being dropped.
    """
    documents: list[tuple[str, dict[str, Any]]] = []
    moves: list[tuple[str, str]] = []
    recycle: list[tuple[str, str]] = []
    unlinks: list[str] = []
    rmdirs: list[str] = []
    for key, staged in changed.items():
        new, old = current[key], committed.get(key)
        documents.append((f"{key}/zarr.json", array_document(new)))
        key_moves, key_recycle = _chunk_moves(key, staged, old, new_spare)
        moves += key_moves
        recycle += key_recycle
        if old is not None:
            unlinks += [chunk_relpath(key, i) for i in range(new.nchunks, old.nchunks)]
    for key in committed.keys() - current.keys():
        old = committed[key]
        unlinks += [chunk_relpath(key, i) for i in range(old.nchunks)]
        unlinks.append(f"{key}/zarr.json")
        rmdirs += [f"{key}/c", key]
    for key, files in (purged or {}).items():
        unlinks += files
        rmdirs += [f"{key}/c", key]
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
    key: str,
    staged: list[str | None],
    old: ArrayMeta | None,
    new_spare: Callable[[], str] | None,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The moves of ``key``'s staged chunks, and (with ``new_spare``) the spares the whole
    committed chunks they replace become."""
    moves: list[tuple[str, str]] = []
    recycle: list[tuple[str, str]] = []
    for i, src in enumerate(staged):
        if src is None:
            continue
        moves.append((src, chunk_relpath(key, i)))
        if new_spare is not None and _whole_chunk(old, i):
            recycle.append((chunk_relpath(key, i), new_spare()))
    return moves, recycle


def _whole_chunk(old: ArrayMeta | None, index: int) -> bool:
    """Whether the last commit holds chunk ``index`` of ``old`` as a whole (unpadded) chunk."""
    return old is not None and index < old.nchunks and old.payload(index)[1] == old.chunk_bytes
