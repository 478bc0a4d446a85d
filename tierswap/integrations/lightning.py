"""Lightning support: checkpoints whose optimizer is a snapshot, never gathered into RAM.

Add one callback::

    from tierswap.integrations.lightning import TierswapCheckpoints
    trainer = Trainer(callbacks=[ModelCheckpoint(...), TierswapCheckpoints()])

Every checkpoint ``X.ckpt`` then stores, in place of each SwapOptimizer's state, a small dict
referencing the snapshot folder ``X.ckpt.tierswap`` next to it (``X.ckpt.tierswap-<i>`` for the
i-th optimizer): hard links to the swap folder's commit. ``ModelCheckpoint``'s ``save_top_k``
rotation removes the snapshot with its file, and ``trainer.fit(ckpt_path=...)`` resumes from
any retained checkpoint, also after the checkpoint files were moved together.

How: Lightning gathers ``optimizer.state_dict()`` into the checkpoint dict before its
``CheckpointIO`` sees the file name. The callback's ``state_dict()`` (which Lightning calls just
before) makes each SwapOptimizer's next ``state_dict()`` snapshot into a pending folder in the
checkpoint folder; the callback wraps the strategy's ``CheckpointIO`` so that the save renames
the pending snapshot next to the file, a load finds it there, and a removal removes it.

Requires ``pytorch-lightning`` (``pip install tierswap[lightning]``).
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

try:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.io import CheckpointIO
except ImportError:  # the unified ``lightning`` package
    import lightning.pytorch as pl  # type: ignore[no-redef]
    from lightning.pytorch.plugins.io import CheckpointIO  # type: ignore[no-redef]

from tierswap.optim import (
    SwapOptimizer,
    find_swap_optimizer,
    retarget_snapshot_reference,
    snapshot_reference_path,
)
from tierswap.store import SwapStore

__all__ = ["SnapshotCheckpointIO", "TierswapCheckpoints", "snapshot_path"]

_pending = itertools.count()


def snapshot_path(checkpoint: str | os.PathLike[str], index: int = 0) -> Path:
    """The snapshot folder of the ``index``-th optimizer of checkpoint file ``checkpoint``."""
    suffix = ".tierswap" if index == 0 else f".tierswap-{index}"
    return Path(f"{os.fspath(checkpoint)}{suffix}")


class SnapshotCheckpointIO(CheckpointIO):
    """Wraps a ``CheckpointIO``: moves pending snapshots next to the file on save, points
    references at them on load, removes them with the file."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        for index, state in enumerate(checkpoint.get("optimizer_states", [])):
            pending = snapshot_reference_path(state)
            if pending is not None:
                beside = snapshot_path(path, index)
                _place(pending, beside)
                retarget_snapshot_reference(state, beside)
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    # **kwargs passes on what each Lightning version adds (weights_only, ...).
    def load_checkpoint(  # type: ignore[override]
        self, path: Any, map_location: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        checkpoint = self.inner.load_checkpoint(path, map_location=map_location, **kwargs)
        for index, state in enumerate(checkpoint.get("optimizer_states", [])):
            beside = snapshot_path(path, index)
            if snapshot_reference_path(state) is not None and beside.is_dir():
                retarget_snapshot_reference(state, beside)  # the snapshot beside the file wins
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        for index in itertools.count():
            folder = snapshot_path(path, index)
            if not folder.is_dir():
                break
            shutil.rmtree(folder)

    def teardown(self) -> None:
        self.inner.teardown()


def _place(pending: Path, dest: Path) -> None:
    """Move the pending snapshot to ``dest`` (a rename, or a copy across filesystems)."""
    if dest.exists():  # the same file name saved again (save_last): replace it
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        pending.rename(dest)
    except OSError:  # another filesystem: copy (reflinks where possible), drop the pending one
        with SwapStore(pending, mode="r") as store:
            store.snapshot(dest)
        shutil.rmtree(pending)


class TierswapCheckpoints(pl.Callback):
    """Save each SwapOptimizer of the Trainer as a snapshot beside each checkpoint file."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, SnapshotCheckpointIO):
            strategy.checkpoint_io = SnapshotCheckpointIO(strategy.checkpoint_io)
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """Called by Lightning right before it gathers the optimizers' state dicts."""
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            for index, opt in self._swap_optimizers(trainer):
                opt.redirect_state_dict(self._pending_folder(trainer, index))
        return {}

    @staticmethod
    def _swap_optimizers(trainer: Any) -> list[tuple[int, SwapOptimizer]]:
        found = [(i, find_swap_optimizer(o)) for i, o in enumerate(trainer.optimizers)]
        return [(i, opt) for i, opt in found if opt is not None]

    @staticmethod
    def _pending_folder(trainer: Any, index: int) -> Path:
        """In the checkpoint folder, so that placing it beside the file is a rename."""
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) or trainer.default_root_dir
        name = f".tierswap-pending-{os.getpid()}-{next(_pending)}-{index}"
        pending = Path(folder).absolute() / name
        shutil.rmtree(pending, ignore_errors=True)
        return pending
