"""The SwapOptimizer's persistence face: commits, torch-format state dicts and snapshots.

The base of :class:`~tierswap.optim._assembly.Assembly`, which builds the parts these
methods work on (the optimizer says how to settle a step under way), apart so that the
optimizer's module holds its public face; the work itself is :mod:`tierswap.optim.persist`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tierswap.optim import persist
from tierswap.optim.persist import OptimizerParts, Requests
from tierswap.store import Progress, SnapshotResult

__all__ = ["Checkpoints"]


class Checkpoints(torch.optim.Optimizer):
    """Commits, state dicts and snapshots of a :class:`~tierswap.SwapOptimizer`."""

    _parts: OptimizerParts
    _requests: Requests  # armed by redirect_state_dict, hint_snapshot_folder

    def _settle(self) -> None:
        """Wait for a step under way (the optimizer's)."""
        raise NotImplementedError

    def _restore(self, meta: dict[str, Any]) -> None:
        """Load the commit ``meta`` describes (the optimizer's)."""
        raise NotImplementedError

    # -- persistence and state dicts ------------------------------------------------------
    def commit(self) -> int:
        """Make the current masters, state and step count the folder's atomic restart point."""
        self._settle()
        return persist.commit(self._parts)

    def _adopt_direct_state(self) -> None:
        """Move state written straight into ``self.state`` (as ``ZeroRedundancyOptimizer.
        load_state_dict`` does) into the swap space."""
        persist.adopt_direct_state(self._parts)

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's own format (materialised in host RAM, as CPU tensors).

        After :meth:`redirect_state_dict`, the next call instead takes a snapshot and returns
        the small reference dict of :meth:`snapshot_state_dict`.
        """
        self._settle()
        dest = self._requests.take_dest()
        if dest is not None:
            return self.snapshot_state_dict(dest)
        self._adopt_direct_state()
        return persist.state_dict(self, self._parts)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in torch's format (from this class or the plain optimizer), or a
        snapshot reference from :meth:`snapshot_state_dict`."""
        self._settle()
        hint = self._requests.take_hint()
        if persist.is_reference(state_dict):
            self.load_snapshot(persist.resolve_reference(state_dict, hint))
            return
        persist.load_state_dict(self._parts, state_dict)
        self._parts.state.changed = True  # the next snapshot commits

    # -- snapshots (see tierswap.optim.persist._snapshot) ----------------------------------
    def snapshot(
        self, dest: str | os.PathLike[str], *, progress: bool | Progress | None = None
    ) -> SnapshotResult:
        """Keep the current state as a standalone store in the new or empty ``dest``: hard
        links to the swap folder's files (no data copied), a copy across filesystems. Commits
        first unless the last commit already holds this state (``commit_every`` did it)."""
        self._settle()
        return persist.snapshot(self._parts, dest, progress=progress)

    def snapshot_state_dict(self, dest: str | os.PathLike[str]) -> dict[str, Any]:
        """:meth:`snapshot` into ``dest`` and return a small dict referencing it, which
        :meth:`load_state_dict` accepts (a trainer checkpoint that never materialises)."""
        return persist.reference(self.snapshot(dest), self._parts.state.steps)

    def redirect_state_dict(self, dest: str | os.PathLike[str] | None) -> None:
        """Make the next :meth:`state_dict` call return :meth:`snapshot_state_dict` of ``dest``
        (``None`` cancels). For trainers that save ``optimizer.state_dict()`` themselves."""
        self._requests.dest = None if dest is None else Path(dest).absolute()

    def hint_snapshot_folder(self, folder: str | os.PathLike[str] | None) -> None:
        """Name the checkpoint folder the next :meth:`load_state_dict` of a snapshot reference
        comes from: where the snapshot is looked for when the absolute path the reference
        records is gone (a moved or copied checkpoint). ``None`` cancels."""
        self._requests.hint = None if folder is None else Path(folder).absolute()

    def load_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Replace the swap folder by the snapshot at ``path`` and resume from it."""
        self._settle()
        source = persist.snapshot_source(path)
        self._parts.backend.reopen_from(source, self._parts.layout.chunk_bytes)
        meta = self._parts.backend.committed_meta()
        assert meta is not None  # checked by snapshot_source
        self._restore(meta)
