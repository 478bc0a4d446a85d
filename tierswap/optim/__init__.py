"""Offloaded optimizers: torch optimizers whose state lives on disk, streamed in slices.

Besides the optimizer and its adapters, the calls trainer integrations build on: finding the
SwapOptimizer inside a framework's wrapper, and handling the small reference dicts that
:meth:`SwapOptimizer.snapshot_state_dict` returns in place of a state dict.
"""

from __future__ import annotations

from tierswap.optim._adapters import find_swap_optimizer, offload, swapped
from tierswap.optim.optimizer import SwapOptimizer
from tierswap.optim.persist import is_reference as is_snapshot_reference
from tierswap.optim.persist import reference_path as snapshot_reference_path
from tierswap.optim.persist import retarget_reference as retarget_snapshot_reference

__all__ = [
    "SwapOptimizer",
    "find_swap_optimizer",
    "is_snapshot_reference",
    "offload",
    "retarget_snapshot_reference",
    "snapshot_reference_path",
    "swapped",
]
