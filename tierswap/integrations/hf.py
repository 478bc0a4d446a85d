"""Hugging Face ``Trainer`` support: tier statistics in the logs, checkpoints as snapshots.

Pass a :class:`~tierswap.SwapOptimizer` as the Trainer's optimizer and add the callback::

    opt = tierswap.SwapOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-5,
                                 swap_dir="/nvme/run", host_budget="4GiB")
    trainer = Trainer(model, args, train_dataset=ds, optimizers=(opt, None),
                      callbacks=[TierswapCallback()])

Each checkpoint the Trainer saves (``save_steps``, ``save_strategy="epoch"``) then holds the
optimizer as a snapshot, ``checkpoint-N/optimizer.tierswap/`` (hard links to the swap folder's
commit at step N: no state gathered into RAM, almost no bytes written), and an ``optimizer.pt``
of a few hundred bytes that references it. ``save_total_limit`` deletes old checkpoint folders
as usual, and ``trainer.train(resume_from_checkpoint=...)`` resumes from any retained one.

Requires ``transformers`` (``pip install tierswap[hf]``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from tierswap.optim import SwapOptimizer, find_swap_optimizer

# find_swap_optimizer lives in tierswap.optim; it stays importable from here as before.
__all__ = ["SNAPSHOT_DIR", "TierswapCallback", "find_swap_optimizer", "flatten_stats"]

#: The optimizer's snapshot inside a checkpoint folder.
SNAPSHOT_DIR = "optimizer.tierswap"


def flatten_stats(stats: dict[str, Any], prefix: str = "tierswap") -> dict[str, float]:
    """``{"host": {"hits": 3}}`` -> ``{"tierswap/host_hits": 3.0}``; numbers only."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}/{key}" if prefix == "tierswap" else f"{prefix}_{key}"
        if isinstance(value, dict):
            flat.update(flatten_stats(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class TierswapCallback(TrainerCallback):
    """Adds the swap cache's statistics to every log entry; checkpoints hold snapshots.

    Parameters
    ----------
    optimizer:
        The SwapOptimizer; ``None`` finds it in the Trainer's optimizer at each event.
    commit_on_save:
        Commit the swap folder when the Trainer saves a checkpoint, so both mark the same step.
    snapshot_on_save:
        Save the optimizer of each checkpoint as a snapshot (``checkpoint-N/optimizer.tierswap``)
        referenced by ``optimizer.pt``, instead of its whole state gathered into RAM.
    """

    def __init__(
        self,
        optimizer: SwapOptimizer | None = None,
        *,
        commit_on_save: bool = True,
        snapshot_on_save: bool = True,
    ):
        self.optimizer = optimizer
        self.commit_on_save = commit_on_save
        self.snapshot_on_save = snapshot_on_save
        self._armed: Path | None = None

    def _optimizer(self, kwargs: dict[str, Any]) -> SwapOptimizer | None:
        return self.optimizer or find_swap_optimizer(kwargs.get("optimizer"))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if opt is None or logs is None:
            return
        stats = flatten_stats(opt.tier_stats())
        stats["tierswap/optimizer_steps"] = float(opt.steps)
        logs.update(stats)
        if state.log_history:  # the Trainer appended its copy of logs before calling us
            state.log_history[-1].update(stats)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._arm(args, state, control, kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._arm(args, state, control, kwargs)

    def _arm(self, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        """The Trainer is about to save: its ``optimizer.state_dict()`` call takes a snapshot.

        Runs after ``DefaultFlowCallback`` has decided ``control.should_save`` for this step;
        the folder is the one ``Trainer._save_checkpoint`` writes (no hyper-parameter search).
        """
        opt = self._optimizer(kwargs)
        if opt is not None and (control.should_save or control.should_evaluate):
            opt.synchronize()  # the model's weights are read next (a step may still run)
        if opt is None or not self.snapshot_on_save or not control.should_save:
            return
        dest = Path(args.output_dir).absolute() / f"checkpoint-{state.global_step}" / SNAPSHOT_DIR
        if dest.exists():  # a checkpoint of this step saved before (a resumed run): replace it
            shutil.rmtree(dest)
        opt.redirect_state_dict(dest)
        self._armed = dest

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        armed, self._armed = self._armed, None
        if opt is None:
            return
        opt.redirect_state_dict(None)  # unused when the Trainer saved no optimizer state
        snapshotted = armed is not None and armed.exists()  # the snapshot committed already
        if self.commit_on_save and not snapshotted:
            opt.commit()
