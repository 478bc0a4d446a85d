"""Hugging Face Accelerate support: ``save_state`` checkpoints whose optimizer is a snapshot.

One call after ``accelerator.prepare(...)``::

    from tierswap.integrations.accelerate import snapshot_checkpoints
    snapshot_checkpoints(accelerator)

Then every ``accelerator.save_state(dir)`` writes each :class:`~tierswap.SwapOptimizer` as a
snapshot ``dir/optimizer.tierswap`` (``optimizer_<i>.tierswap`` for the i-th optimizer; hard
links to the swap folder's commit, nothing gathered into RAM) plus a tiny ``optimizer.bin``
referencing it, and ``accelerator.load_state(dir)`` resumes from it. ``ProjectConfiguration``'s
``total_limit`` rotation works unchanged: deleting a checkpoint folder deletes its snapshot.

Uses accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tierswap.optim import SwapOptimizer, find_swap_optimizer

__all__ = ["SnapshotCheckpoints", "snapshot_checkpoints", "snapshot_name"]


def snapshot_name(index: int) -> str:
    """The snapshot folder of the ``index``-th optimizer, named like accelerate's files."""
    return "optimizer.tierswap" if index == 0 else f"optimizer_{index}.tierswap"


class SnapshotCheckpoints:
    """The registered hooks; :meth:`remove` unregisters them."""

    def __init__(self, accelerator: Any, optimizers: tuple[Any, ...]) -> None:
        self._accelerator = accelerator
        self._optimizers = optimizers
        self._handles = [
            accelerator.register_save_state_pre_hook(self._before_save),
            accelerator.register_load_state_pre_hook(self._before_load),
        ]

    def _swap_optimizers(self) -> list[tuple[int, SwapOptimizer]]:
        """(accelerate's index of the optimizer, the SwapOptimizer inside it)."""
        prepared = list(getattr(self._accelerator, "_optimizers", []))
        candidates = self._optimizers or tuple(prepared)
        found = []
        for position, candidate in enumerate(candidates):
            opt = find_swap_optimizer(candidate)
            if opt is None:
                continue
            index = next(
                (i for i, p in enumerate(prepared) if find_swap_optimizer(p) is opt), position
            )
            found.append((index, opt))
        return found

    def _before_save(self, _models: Any, _weights: Any, output_dir: str) -> None:
        """Arm each SwapOptimizer: accelerate's ``state_dict()`` call takes the snapshot."""
        for index, opt in self._swap_optimizers():
            dest = Path(output_dir).absolute() / snapshot_name(index)
            if dest.exists():  # save_state into a folder saved before: replace, as accelerate does
                shutil.rmtree(dest)
            opt.redirect_state_dict(dest)

    def _before_load(self, _models: Any, input_dir: str) -> None:
        """``load_state_dict`` follows the reference in optimizer.bin; should the checkpoint
        have moved since it was saved, the snapshot is looked for in ``input_dir``."""
        for _index, opt in self._swap_optimizers():
            opt.hint_snapshot_folder(input_dir)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def snapshot_checkpoints(accelerator: Any, *optimizers: Any) -> SnapshotCheckpoints:
    """Make ``accelerator.save_state`` / ``load_state`` keep SwapOptimizers as snapshots.

    ``optimizers``: the (prepared) optimizers to handle; default every prepared optimizer that
    is or wraps a :class:`~tierswap.SwapOptimizer`.
    """
    return SnapshotCheckpoints(accelerator, optimizers)
