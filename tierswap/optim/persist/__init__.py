"""Persistence: the swap folder the state lives in, its commits, resumes, snapshots and state
dicts.

Owns the store and the pipeline over it (:class:`StateBackend`), what the optimizer knows of its
state beside the stored arrays (:class:`StepState`), when a step ends with a commit
(:class:`CommitClock`), and every way the state enters or leaves the folder: commits and resumes,
torch's state dicts, snapshots and the small reference dicts that stand for them.

The helpers take one :class:`OptimizerParts`, which the optimizer builds once.

- ``_parts``: :class:`OptimizerParts`;
- ``_backend``: :class:`StateBackend`, the store and the pipeline over it;
- ``_bookkeeping``: :class:`StepState`, what the optimizer knows beside the stored arrays;
- ``_commit_clock``: :class:`CommitClock`, when a step ends with a commit;
- ``_arrays``: the arrays a slot starts with, and writing masters and parameters;
- ``_commit``: commits, and the last one at ``close()``;
- ``_resume``: whether a commit fits (parameters and groups matched by name), and loading it;
- ``_torch_format``: ``state_dict()`` and ``load_state_dict()`` in torch's format;
- ``_swapped_state``: :class:`SwappedState` (``optimizer.state``) and state written into it;
- ``_snapshot``: snapshots, and the reference dicts trainer checkpoints hold instead.
"""

from __future__ import annotations

from tierswap.optim.persist._arrays import (
    create_arrays,
    read_master,
    restore_params,
    write_lagging_masters,
    write_master,
)
from tierswap.optim.persist._backend import StateBackend
from tierswap.optim.persist._bookkeeping import StepState, hyper_parameters, same_values
from tierswap.optim.persist._commit import commit, commit_behind, drain_writes, final_commit
from tierswap.optim.persist._commit_clock import AUTO_SHARE, CommitClock
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.persist._resume import check_commit, restore_commit
from tierswap.optim.persist._snapshot import (
    Requests,
    is_reference,
    reference,
    reference_path,
    resolve_reference,
    retarget_reference,
    seed_swap_dir,
    snapshot,
    snapshot_source,
)
from tierswap.optim.persist._swapped_state import SwappedState, adopt_direct_state
from tierswap.optim.persist._torch_format import load_state_dict, state_dict

__all__ = [
    "hyper_parameters",
    "restore_params",
    "same_values",
    "AUTO_SHARE",
    "CommitClock",
    "OptimizerParts",
    "Requests",
    "StateBackend",
    "StepState",
    "SwappedState",
    "adopt_direct_state",
    "create_arrays",
    "check_commit",
    "commit",
    "commit_behind",
    "drain_writes",
    "final_commit",
    "is_reference",
    "load_state_dict",
    "read_master",
    "reference",
    "reference_path",
    "resolve_reference",
    "restore_commit",
    "retarget_reference",
    "seed_swap_dir",
    "snapshot",
    "snapshot_source",
    "state_dict",
    "write_lagging_masters",
    "write_master",
]
