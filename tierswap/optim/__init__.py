"""Offloaded optimizers: torch optimizers whose state lives on disk, streamed in slices.

Besides the optimizer and its adapters, the calls trainer integrations build on: finding the
SwapOptimizer inside a framework's wrapper, and handling the small reference dicts that
:meth:`SwapOptimizer.snapshot_state_dict` returns in place of a state dict.
"""

from __future__ import annotations

from tierswap.optim._convert import find_swap_optimizer, offload, swapped
from tierswap.optim._snapshot import is_reference as is_snapshot_reference
from tierswap.optim._snapshot import reference_path as snapshot_reference_path
from tierswap.optim._snapshot import retarget_reference as retarget_snapshot_reference
from tierswap.optim.optimizer import SwapOptimizer

__all__ = [
    "SwapOptimizer",
    "find_swap_optimizer",
    "is_snapshot_reference",
    "offload",
    "retarget_snapshot_reference",
    "snapshot_reference_path",
    "swapped",
]
