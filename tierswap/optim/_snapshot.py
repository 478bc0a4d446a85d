"""Optimizer snapshots: checkpoints whose state stays on disk, as hard links to one commit.

A trainer checkpoint normally calls ``optimizer.state_dict()``, which gathers every swapped
tensor into RAM. With a snapshot it holds instead a small *reference* dict::

    {"tierswap_snapshot": {"path": "/abs/checkpoint-100/optimizer.tierswap",
                           "generation": 7, "steps": 100, "format": 1}}

and the folder it names: a standalone swap store of the optimizer's commit at that step
(:func:`tierswap.store._snapshot.take_snapshot`). Loading the reference replaces the live swap
folder with (hard links to) the snapshot and resumes from it, like ``resume=True``.
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim import _state_dict
from tierswap.optim._backend import META_KEY, StateBackend, resolve_swap_dir
from tierswap.optim.distributed import check_same_step, rank_swap_dir
from tierswap.store import (
    Progress,
    SnapshotResult,
    StorePaths,
    check_apart,
    check_destination,
    replace_with_snapshot,
)

if TYPE_CHECKING:
    from tierswap.optim.optimizer import SwapOptimizer

__all__ = [
    "REFERENCE_KEY",
    "hint_folder",
    "is_reference",
    "load_reference",
    "load_snapshot",
    "mark_changed",
    "redirect",
    "redirected_state_dict",
    "reference",
    "reference_path",
    "retarget_reference",
    "seed_swap_dir",
    "snapshot",
]

#: The one key of a reference state dict.
REFERENCE_KEY = "tierswap_snapshot"
_FORMAT = 1


def snapshot(
    optimizer: SwapOptimizer, dest: str | os.PathLike[str], *, progress: bool | Progress | None
) -> SnapshotResult:
    """Commit the optimizer (unless its last commit is of this very state), then keep that
    commit as a store in ``dest`` (new or empty).

    Under ``torch.distributed`` each rank keeps its own folder's commit in ``dest/rank-<r>``,
    after checking (a collective: every rank must call this) that all ranks are at one step.
    """
    backend = optimizer._backend
    dest = rank_swap_dir(Path(dest).absolute())
    check_destination(backend.folders, dest)  # fail before committing
    check_same_step(optimizer.steps, backend.path, "snapshot")
    if _needs_commit(optimizer):
        optimizer.commit()
        optimizer._snapshot_changed = False
    return backend.store.snapshot(dest, progress=progress)


def _needs_commit(optimizer: SwapOptimizer) -> bool:
    """False when the last commit already holds this state (``commit_every`` committed this
    step), so a snapshot writes no data at all; state loaded since then forces a commit."""
    backend = optimizer._backend
    meta = backend.committed_meta()
    if (
        meta is None
        or getattr(optimizer, "_snapshot_changed", False)
        or meta.get("steps") != optimizer.steps
        or len(meta.get("layout", [])) != len(optimizer._slots)
    ):
        return True
    # hyper-parameters changed since (an LR scheduler steps after the optimizer's commit)
    current = [_state_dict.hyper_parameters(g) for g in optimizer.param_groups]
    return not _same(backend.load_small()["groups"], current)


def _same(a: Any, b: Any) -> bool:
    """Equality of nested dicts, lists and tensors (``==`` is ambiguous on tensors)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def mark_changed(optimizer: SwapOptimizer) -> None:
    """The state changed outside ``step()`` (a loaded state dict): the next snapshot commits."""
    optimizer._snapshot_changed = True


def reference(optimizer: SwapOptimizer, dest: str | os.PathLike[str]) -> dict[str, Any]:
    """Snapshot into ``dest`` and return the small dict that :func:`load_reference` reads."""
    result = snapshot(optimizer, dest, progress=None)
    return {
        REFERENCE_KEY: {
            "path": str(result.path),
            "name": result.path.name,
            "generation": result.generation,
            "steps": optimizer.steps,
            "format": _FORMAT,
        }
    }


def redirect(optimizer: SwapOptimizer, dest: str | os.PathLike[str] | None) -> None:
    """Make the next ``state_dict()`` call return :func:`reference` into ``dest``."""
    optimizer._state_dict_dest = None if dest is None else Path(dest).absolute()


def redirected_state_dict(optimizer: SwapOptimizer) -> dict[str, Any] | None:
    """The reference for an armed ``state_dict()`` call (disarming it), else ``None``."""
    dest = getattr(optimizer, "_state_dict_dest", None)
    if dest is None:
        return None
    optimizer._state_dict_dest = None
    return reference(optimizer, dest)


def hint_folder(optimizer: SwapOptimizer, folder: str | os.PathLike[str] | None) -> None:
    """The checkpoint folder the next reference is loaded from: where to look for the snapshot
    when the absolute path it records is gone (a moved or copied checkpoint)."""
    optimizer._snapshot_hint = None if folder is None else Path(folder).absolute()


def is_reference(state_dict: Any) -> bool:
    """Whether ``state_dict`` is a snapshot reference (:func:`reference`), not torch's format."""
    return isinstance(state_dict, dict) and REFERENCE_KEY in state_dict


def reference_path(state_dict: Any) -> Path | None:
    """The snapshot folder a reference state dict (:func:`reference`) names; ``None`` for
    any other state dict."""
    return Path(state_dict[REFERENCE_KEY]["path"]) if is_reference(state_dict) else None


def retarget_reference(state_dict: dict[str, Any], folder: str | os.PathLike[str]) -> None:
    """Make the reference state dict name ``folder``, where its snapshot was moved or copied."""
    if not is_reference(state_dict):
        raise ConfigError("the state dict is not a tierswap snapshot reference")
    path = Path(folder).absolute()
    state_dict[REFERENCE_KEY].update(path=str(path), name=path.name)


def load_reference(optimizer: SwapOptimizer, state_dict: dict[str, Any]) -> None:
    """Resume from the snapshot a reference dict names."""
    ref = state_dict[REFERENCE_KEY]
    if int(ref.get("format", 0)) != _FORMAT:
        raise ConfigError(f"tierswap snapshot reference {ref!r} has an unknown format")
    path = Path(ref["path"])
    hint = getattr(optimizer, "_snapshot_hint", None)
    optimizer._snapshot_hint = None
    if not (path / "zarr.json").exists() and hint is not None and "name" in ref:
        path = hint / ref["name"]  # the checkpoint folder was moved or copied
    if not (path / "zarr.json").exists():
        raise ConfigError(
            f"the optimizer checkpoint references the snapshot {str(path)!r}, which is gone; "
            "if the checkpoint folder was moved, call optimizer.load_snapshot(<new path>)"
        )
    load_snapshot(optimizer, path)


def load_snapshot(optimizer: SwapOptimizer, path: str | os.PathLike[str]) -> None:
    """Replace the live swap folder with the snapshot at ``path`` and resume from it."""
    config = optimizer._config
    source = _rank_source(Path(path).absolute())
    old = optimizer._backend
    live, folders = old.path, old.folders
    for folder in folders:
        check_apart(source, folder)
    _check_optimizer_snapshot(source)
    temporary = config.swap_dir is None
    optimizer._finalizer.detach()
    old.close()  # removes a temporary folder, which the snapshot then recreates
    replace_with_snapshot(source, folders)
    backend = StateBackend(
        live if temporary else config.swap_dir,
        budget=optimizer.host_budget,
        durable=config.durable,
        resume=True,
        chunk_bytes=optimizer._chunk_bytes,
    )
    optimizer._backend = backend
    optimizer._finalizer = weakref.finalize(optimizer, _close, backend, live if temporary else None)
    optimizer._finalizer.atexit = False
    meta = backend.committed_meta()
    assert meta is not None  # checked by _check_optimizer_snapshot
    _state_dict.restore_commit(optimizer, meta)
    optimizer._stepped.clear()


def seed_swap_dir(swap_dir: StorePaths, resume_from: str | os.PathLike[str]) -> None:
    """For ``resume_from``: make ``swap_dir`` (a folder, or one per drive) a copy (by hard
    links) of the snapshot."""
    live, _temporary = resolve_swap_dir(swap_dir)
    source = _rank_source(Path(resume_from).absolute())
    _check_optimizer_snapshot(source)
    replace_with_snapshot(source, live)


def _rank_source(path: Path) -> Path:
    """``path/rank-<r>`` when a per-rank snapshot lies there, else ``path``."""
    ranked = rank_swap_dir(path)
    return ranked if ranked != path and ranked.is_dir() else path


def _check_optimizer_snapshot(path: Path) -> None:
    from tierswap.store import SwapStore

    if not (path / "zarr.json").exists():
        raise ConfigError(f"no snapshot at {str(path)!r} (no zarr.json); check the path")
    with SwapStore(path, mode="r") as store:
        if META_KEY not in (store.meta or {}):
            raise ConfigError(
                f"store {str(path)!r} holds no SwapOptimizer commit; pass a snapshot taken by "
                "SwapOptimizer.snapshot() or a trainer checkpoint's optimizer.tierswap folder"
            )


def _close(backend: StateBackend, temporary: Path | None) -> None:
    try:
        backend.close()
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
