"""Hugging Face ``Trainer`` support: tier statistics in the logs, commits with checkpoints.

Pass a :class:`~tierswap.SwapOptimizer` as the Trainer's optimizer and add the callback::

    opt = tierswap.SwapOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-5,
                                 swap_dir="/nvme/run", host_budget="4GiB")
    trainer = Trainer(model, args, train_dataset=ds, optimizers=(opt, None),
                      callbacks=[TierswapCallback()])

Requires ``transformers`` (``pip install tierswap[hf]``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from tierswap.optim import SwapOptimizer

__all__ = ["TierswapCallback", "find_swap_optimizer", "flatten_stats"]


def find_swap_optimizer(optimizer: Any) -> SwapOptimizer | None:
    """The SwapOptimizer inside ``optimizer`` (accelerate wraps it in ``.optimizer``), if any."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, SwapOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


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
    """Adds the swap cache's statistics to every log entry, and commits on each save.

    Parameters
    ----------
    optimizer:
        The SwapOptimizer; ``None`` finds it in the Trainer's optimizer at each event.
    commit_on_save:
        Commit the swap folder when the Trainer saves a checkpoint, so both mark the same step.
    """

    def __init__(self, optimizer: SwapOptimizer | None = None, *, commit_on_save: bool = True):
        self.optimizer = optimizer
        self.commit_on_save = commit_on_save

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

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if opt is not None and self.commit_on_save:
            opt.commit()
