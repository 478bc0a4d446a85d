"""Glue for training frameworks. Each submodule imports its framework; import it explicitly.

``tierswap.integrations.hf``: :class:`~tierswap.integrations.hf.TierswapCallback` for the
Hugging Face ``Trainer``.
``tierswap.integrations.accelerate``: ``snapshot_checkpoints(accelerator)`` for ``save_state``.
``tierswap.integrations.lightning``: the ``TierswapCheckpoints`` Lightning callback.
Each makes trainer checkpoints hold the optimizer as a snapshot (docs/checkpoints.md).
"""

from __future__ import annotations

__all__: list[str] = []
