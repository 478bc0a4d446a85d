"""Persistence: the swap folder the state lives in, its commits, resumes, snapshots and state
dicts.

Owns the store and the pipeline over it (:class:`StateBackend`), what the optimizer knows of its
state beside the stored arrays (:class:`StepState`), when a step ends with a commit
(:class:`CommitClock`), and every way the state enters or leaves the folder: commits and resumes,
torch's state dicts, snapshots and the small reference dicts that stand for them.
"""

from __future__ import annotations

from tierswap.optim.persist._arrays import base_arrays, write_params
from tierswap.optim.persist._backend import StateBackend
from tierswap.optim.persist._bookkeeping import StepState
from tierswap.optim.persist._commit import commit, drain_writes, final_commit
from tierswap.optim.persist._commit_clock import AUTO_SHARE, CommitClock
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
    "AUTO_SHARE",
    "CommitClock",
    "Requests",
    "StateBackend",
    "StepState",
    "SwappedState",
    "adopt_direct_state",
    "base_arrays",
    "check_commit",
    "commit",
    "drain_writes",
    "final_commit",
    "is_reference",
    "load_state_dict",
    "reference",
    "reference_path",
    "resolve_reference",
    "restore_commit",
    "retarget_reference",
    "seed_swap_dir",
    "snapshot",
    "snapshot_source",
    "state_dict",
    "write_params",
]
