"""Offloaded optimizers: torch optimizers whose state lives on disk, streamed in slices.

Besides the optimizer and its adapters, the calls trainer integrations build on: finding the
SwapOptimizer inside a framework's wrapper, and handling the small reference dicts that
:meth:`SwapOptimizer.snapshot_state_dict` returns in place of a state dict.

The package is grouped by job; data flows down (an import-linter contract holds it):

- the public face: :mod:`~tierswap.optim.optimizer` (:class:`SwapOptimizer`; its commits,
  state dicts and snapshots in ``_checkpoints``), ``_adapters``
  (:func:`offload`, :func:`swapped`, :func:`find_swap_optimizer`), ``_config`` (the settings)
  and :mod:`~tierswap.optim.distributed` (per-rank folders and checks);
- :mod:`tierswap.optim.step`: how a step runs its slices, and when;
- :mod:`tierswap.optim.stream`: the model's parameters and gradients in the swap space
  (``offload_parameters=True``), read before each use;
- :mod:`tierswap.optim.persist`: the swap folder, commits, resumes, state dicts, snapshots;
- :mod:`tierswap.optim.plan`: slots, slices, layout: what is stepped in which pieces, where;
- :mod:`tierswap.optim.formats`: compact state (bf16 and 8-bit moments, master remainders).
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
