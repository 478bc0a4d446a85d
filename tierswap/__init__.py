"""tierswap: tiered GPU / pinned host / NVMe swap space and offloaded optimizers for PyTorch."""

from __future__ import annotations

from tierswap import errors
from tierswap.config import IOConfig, parse_size
from tierswap.store import ArrayInfo, SwapStore

__all__ = ["ArrayInfo", "IOConfig", "SwapStore", "errors", "parse_size"]
__version__ = "0.1.0"
