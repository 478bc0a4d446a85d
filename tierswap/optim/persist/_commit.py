"""Commits: the swap folder's atomic restart points, and the last one at ``close()``."""

from __future__ import annotations

import datetime
import time
import warnings
from typing import Any

from tierswap.errors import FailedStepError, StoreClosedError
from tierswap.optim.distributed import world_meta
from tierswap.optim.persist._arrays import write_lagging_masters, write_params
from tierswap.optim.persist._bookkeeping import clone_state, hyper_parameters
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.persist._swapped_state import adopt_direct_state
from tierswap.optim.plan import Slot, master_dtype
from tierswap.pipeline import Region

__all__ = [
    "commit",
    "commit_behind",
    "drain_writes",
    "final_commit",
    "layout_entry",
    "steps_of",
]


def layout_entry(slot: Slot) -> list[Any]:
    """What must match between a slot and the parameter of a commit it resumes."""
    return [list(slot.local.shape), str(master_dtype(slot.param)), slot.has_master]


def commit(parts: OptimizerParts) -> int:
    """Make the current masters, state and step count the folder's atomic restart point; the
    commit clock learns what it cost. Returns the generation."""
    started = time.monotonic()
    lagged, small, meta = _prepare(parts)
    try:
        generation = parts.backend.commit(small, meta)
    except BaseException:
        _lagged_again(parts, lagged)
        raise
    _committed(parts, started, time.monotonic())
    return generation


def commit_behind(parts: OptimizerParts) -> None:
    """:func:`commit`, ending behind the caller: it returns once the resident slices' writes
    have started, and the next use of the swap space waits for the rest (those writes, the
    store's commit: :meth:`~tierswap.optim.persist.StateBackend.commit_behind`). Until then
    nothing changes what they write from, since every change of state goes through that use
    first. A failure is raised by it; the masters that lagged are then written by the next
    commit again, as after a failed :func:`commit`. The clock learns the time from here to
    the store's commit."""
    started = time.monotonic()
    lagged, small, meta = _prepare(parts)

    def ended(error: BaseException | None, at: float) -> None:
        if error is None:
            _committed(parts, started, at, behind=True)
        else:
            _lagged_again(parts, lagged)

    try:
        parts.backend.commit_behind(small, meta, ended)
    except BaseException:  # its writes did not all start
        _lagged_again(parts, lagged)
        raise


def _prepare(
    parts: OptimizerParts,
) -> tuple[dict[int, set[Region]], dict[str, Any], dict[str, Any]]:
    """What a commit does before the store's: adopt state written straight into the torch
    optimizer, wait for the steps' writes, write params without a master (those the last
    step did not) and the masters that lag their parameters' values. Returns those masters'
    regions, the commit's small state and its metadata (:func:`_contents`)."""
    adopt_direct_state(parts)
    backend, step_state = parts.backend, parts.state
    drain_writes(parts)
    if step_state.failed:
        committed = steps_of(backend.committed_meta())
        raise FailedStepError(
            f"swap_dir {str(backend.path)!r}: a step failed part-way and left the state between "
            "two steps, so it is not committed; load a state (load_state_dict, load_snapshot) "
            f"or reopen with resume=True to continue from step {committed}"
        )
    unwritten = [  # a streamed parameter's stored values are current but for lagging masters
        s
        for s in parts.layout.slots
        if s.persists_param and not s.streamed and s.index not in step_state.params_written
    ]
    write_params(parts, unwritten, masters=False)
    lagged = write_lagging_masters(parts)
    small, meta = _contents(parts)
    return lagged, small, meta


def _lagged_again(parts: OptimizerParts, lagged: dict[int, set[Region]]) -> None:
    """A commit failed: the masters it wrote are not known to have landed, so the next
    commit writes them again."""
    for index, regions in lagged.items():
        parts.state.unwritten_masters.setdefault(index, set()).update(regions)


def _committed(
    parts: OptimizerParts, started: float, ended: float, *, behind: bool = False
) -> None:
    """A commit that started at ``started`` ended at ``ended`` (``time.monotonic()``),
    ``behind`` its step or not."""
    parts.state.changed = False  # the commit holds any state loaded before it
    parts.commits.committed(ended - started, behind=behind)


def _contents(parts: OptimizerParts) -> tuple[dict[str, Any], dict[str, Any]]:
    """A commit's small state (the scalars and hyper-parameters of the param groups, keyed
    by each parameter's key prefix, so that a resume can match by name) and its metadata."""
    layout, step_state, config = parts.layout, parts.state, parts.config
    slots = layout.slots
    small = {
        "small": {s.prefix: clone_state(step_state.small[s.index]) for s in slots},
        "names": {s.prefix: list(step_state.names[s.index]) for s in slots},
        "groups": [hyper_parameters(g) for g in parts.groups],
        "steps": step_state.steps,
    }
    meta = {
        "steps": step_state.steps,
        "optimizer": parts.optimizer_name,
        "layout": [layout_entry(s) for s in slots],
        "keys": [s.prefix for s in slots],
        "names": [s.name for s in slots],
        "groups": [s.group for s in slots],  # a resume matches param groups by their members
        "chunk_bytes": layout.chunk_bytes,
        "state_precision": config.state_precision,
        "master": config.master,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **world_meta(),
    }
    return small, meta


def drain_writes(parts: OptimizerParts) -> None:
    """Wait for the steps' write-behinds; raise the first that failed.

    A failed write-behind lost a slice's new state (its buffers went back to the pool) and
    left the old one in the store, and the pipeline raises it only once: the state is marked
    ``failed`` first, so that no later commit at ``close()`` holds a mix of old and new.
    """
    try:
        parts.backend.pipeline.drain()
    except BaseException:
        parts.state.failed = True
        raise


def steps_of(meta: dict[str, Any] | None) -> int:
    """The step count a commit's metadata holds (0: no commit yet)."""
    return 0 if meta is None else int(meta.get("steps", 0))


def final_commit(parts: OptimizerParts) -> None:
    """At ``close()``: commit the steps (or loaded state) since the last commit, where a resume
    can use the commit; warn when there are such steps that cannot be committed."""
    backend, config, step_state = parts.backend, parts.config, parts.state
    if backend.closed or config.swap_dir is None:
        return  # closed already, or a temporary folder that close() removes
    if not config.durable:  # a scratch store keeps the newest values, written in place
        if not step_state.failed:
            write_lagging_masters(parts)
        return
    meta = backend.committed_meta()
    committed = steps_of(meta)
    if committed == step_state.steps and not step_state.changed:
        return
    where = f"swap_dir {str(backend.path)!r}"
    world = world_meta()
    if meta is not None and any(meta.get(k, 0 if k == "rank" else 1) != world[k] for k in world):
        reason = "the torch.distributed process group was destroyed before close()"
    elif step_state.failed or step_state.plan is not None:
        reason = "a step failed (or is under way) and left the state between two steps"
    else:
        reason = ""
    if reason:
        warnings.warn(
            f"{where}: steps after step {committed} were not committed, because {reason}; "
            f"resume=True continues from step {committed}",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    try:
        commit(parts)
    except Exception as exc:
        # The store closed under an open backend: a commit failed past its commit point (the
        # journal holds it), and the reopen of a resume finishes it.
        resume = (
            "resume=True finishes that commit and continues from the step it holds"
            if isinstance(exc, StoreClosedError)
            else f"resume=True continues from step {committed}"
        )
        warnings.warn(
            f"{where}: close() could not commit steps {committed + 1}..{step_state.steps} "
            f"({type(exc).__name__}: {exc}); {resume}",
            RuntimeWarning,
            stacklevel=3,
        )
