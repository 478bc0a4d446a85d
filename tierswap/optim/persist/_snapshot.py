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

import dataclasses
import os
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError
from tierswap.optim.distributed import check_same_step, rank_swap_dir
from tierswap.optim.persist._backend import META_KEY, StateBackend, resolve_swap_dir
from tierswap.optim.persist._bookkeeping import StepState, hyper_parameters, same_values
from tierswap.optim.persist._commit import commit
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.store import (
    Progress,
    SnapshotResult,
    StorePaths,
    check_destination,
    replace_with_snapshot,
)

__all__ = [
    "REFERENCE_KEY",
    "Requests",
    "is_reference",
    "reference",
    "reference_path",
    "resolve_reference",
    "retarget_reference",
    "seed_swap_dir",
    "snapshot",
    "snapshot_source",
]

#: The one key of a reference state dict.
REFERENCE_KEY = "tierswap_snapshot"
_FORMAT = 1


@dataclasses.dataclass
class Requests:
    """One-shot requests a trainer integration arms on an optimizer: the folder the next
    ``state_dict()`` snapshots into (``dest``), and the checkpoint folder the next reference
    is loaded from (``hint``: where to look should the snapshot have moved)."""

    dest: Path | None = None
    hint: Path | None = None

    def take_dest(self) -> Path | None:
        dest, self.dest = self.dest, None
        return dest

    def take_hint(self) -> Path | None:
        hint, self.hint = self.hint, None
        return hint


def snapshot(
    parts: OptimizerParts, dest: str | os.PathLike[str], *, progress: bool | Progress | None
) -> SnapshotResult:
    """Commit (unless the last commit is of this very state), then keep that commit as a
    store in ``dest`` (new or empty).

    Under ``torch.distributed`` each rank keeps its own folder's commit in ``dest/rank-<r>``,
    after checking (a collective: every rank must call this) that all ranks are at one step.
    """
    backend, step_state = parts.backend, parts.state
    dest = rank_swap_dir(Path(dest).absolute())
    check_destination(backend.folders, dest)  # fail before committing
    check_same_step(step_state.steps, backend.path, "snapshot")
    if step_state.failed or _needs_commit(backend, step_state, parts.groups):
        commit(parts)  # after a failed step it raises: that state is no step's end
    return backend.store.snapshot(dest, progress=progress)


def _needs_commit(
    backend: StateBackend, step_state: StepState, groups: list[dict[str, Any]]
) -> bool:
    """False when the last commit already holds this state (``commit_every`` committed this
    step), so a snapshot writes no data at all; state loaded since then forces a commit."""
    meta = backend.committed_meta()
    params = sum(len(group["params"]) for group in groups)
    if (
        meta is None
        or step_state.changed
        or meta.get("steps") != step_state.steps
        or len(meta.get("layout", [])) != params  # a param group added since
    ):
        return True
    # hyper-parameters changed since (an LR scheduler steps after the optimizer's commit)
    current = [hyper_parameters(g) for g in groups]
    return not same_values(backend.load_small()["groups"], current)


def reference(result: SnapshotResult, steps: int) -> dict[str, Any]:
    """The small dict naming the snapshot ``result`` of step ``steps``, which
    :func:`resolve_reference` reads back."""
    return {
        REFERENCE_KEY: {
            "path": str(result.path),
            "name": result.path.name,
            "generation": result.generation,
            "steps": steps,
            "format": _FORMAT,
        }
    }


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


def resolve_reference(state_dict: dict[str, Any], hint: Path | None) -> Path:
    """The snapshot folder a reference dict names: where it was taken, else, when that is gone,
    the folder of the same name in ``hint`` (a moved or copied checkpoint); or raise."""
    ref = state_dict[REFERENCE_KEY]
    if int(ref.get("format", 0)) != _FORMAT:
        raise ConfigError(f"tierswap snapshot reference {ref!r} has an unknown format")
    path = Path(ref["path"])
    if not (path / "zarr.json").exists() and hint is not None and "name" in ref:
        path = hint / ref["name"]  # the checkpoint folder was moved or copied
    if not (path / "zarr.json").exists():
        raise ConfigError(
            f"the optimizer checkpoint references the snapshot {str(path)!r}, which is gone; "
            "if the checkpoint folder was moved, call optimizer.load_snapshot(<new path>)"
        )
    return path


def snapshot_source(path: str | os.PathLike[str]) -> Path:
    """The folder of an optimizer snapshot at ``path`` (this rank's ``rank-<r>`` in a per-rank
    snapshot); raises ``ConfigError`` when it holds no SwapOptimizer commit."""
    source = _rank_source(Path(path).absolute())
    _check_optimizer_snapshot(source)
    return source


def seed_swap_dir(swap_dir: StorePaths, resume_from: str | os.PathLike[str]) -> None:
    """For ``resume_from``: make ``swap_dir`` (a folder, or one per drive) a copy (by hard
    links) of the snapshot."""
    live, _temporary = resolve_swap_dir(swap_dir)
    replace_with_snapshot(snapshot_source(resume_from), live)


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
