"""Glue for training frameworks. Each submodule imports its framework; import it explicitly.

``tierswap.integrations.hf``: :class:`~tierswap.integrations.hf.TierswapCallback` for the
Hugging Face ``Trainer``.
"""

from __future__ import annotations

__all__: list[str] = []
