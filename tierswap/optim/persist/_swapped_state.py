"""``SwapOptimizer.state``, and state written into it directly."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from tierswap.errors import ConfigError
from tierswap.optim.persist._bookkeeping import StepState
from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.persist._torch_format import replace_states

__all__ = ["SwappedState", "adopt_direct_state"]


class SwappedState(defaultdict[torch.Tensor, dict[str, Any]]):
    """``SwapOptimizer.state``: empty between calls, because the state lives in the swap space.

    It is true whenever the swap space holds state (``step_state`` says), so torch's "is the state
    initialised?" check (``torch.distributed.checkpoint.state_dict`` takes a zero-gradient step
    otherwise) sees the state. Entries written into it directly, as ``ZeroRedundancyOptimizer.
    load_state_dict`` does to its local optimizer, move into the swap space at the next
    ``step()``, ``commit()`` or ``state_dict()`` (:func:`adopt_direct_state`).
    """

    def __init__(self, step_state: StepState | None = None) -> None:
        super().__init__(dict)
        self._step_state = step_state

    def __bool__(self) -> bool:
        held = self._step_state is not None and self._step_state.holds_state()
        return len(self) > 0 or held


def adopt_direct_state(parts: OptimizerParts) -> None:
    """Move state written straight into the optimizer's ``state`` (``parts.swapped_state``)
    into the swap space, and empty it."""
    direct = parts.swapped_state
    for param, state in list(dict.items(direct)):
        slot = parts.layout.slot_of.get(id(param))
        if slot is None:
            raise ConfigError(
                f"optimizer.state holds a tensor of shape {tuple(param.shape)} that is not one "
                "of this optimizer's parameters; load state with load_state_dict()"
            )
        replace_states(parts, [(slot, state)])
    direct.clear()
