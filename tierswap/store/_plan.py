"""Turn "what was committed" and "what is current" into the file operations of one commit.

Pure functions: no I/O, so the commit logic can be tested on its own. The journal module applies
the result crash-safely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from tierswap.store._layout import (
    ArrayMeta,
    array_document,
    chunk_relpath,
    group_document,
    root_document,
)

__all__ = ["Changes", "plan_changes"]


@dataclasses.dataclass
class Changes:
    """Documents to write and files to move, unlink or remove for one commit."""

    documents: list[tuple[str, dict[str, Any]]]  # (final relpath, zarr.json content)
    chunk_moves: list[tuple[str, str]]  # (staged relpath, final relpath)
    unlinks: list[str]
    rmdirs: list[str]


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
) -> Changes:
    """Plan the commit from ``committed`` to ``current``.

    ``changed`` maps each key whose data or metadata changed to the relpaths of its staged
    chunk files, by chunk index (``None`` for a chunk already in place: not rewritten since the
    last commit, or written in place as in scratch mode; an empty list when none is staged).
    ``purged`` maps deleted keys whose metadata was unreadable to the relpaths of their files.
    """
    documents: list[tuple[str, dict[str, Any]]] = []
    moves: list[tuple[str, str]] = []
    unlinks: list[str] = []
    rmdirs: list[str] = []
    for key, staged in changed.items():
        new = current[key]
        documents.append((f"{key}/zarr.json", array_document(new)))
        moves += [(src, chunk_relpath(key, i)) for i, src in enumerate(staged) if src is not None]
        old = committed.get(key)
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
    return Changes(documents, moves, unlinks, _depth_first(rmdirs))
