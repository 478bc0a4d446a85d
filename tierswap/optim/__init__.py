"""Offloaded optimizers: torch optimizers whose state lives on disk, streamed in slices."""

from __future__ import annotations

from tierswap.optim._convert import offload, swapped
from tierswap.optim.optimizer import SwapOptimizer

__all__ = ["SwapOptimizer", "offload", "swapped"]
