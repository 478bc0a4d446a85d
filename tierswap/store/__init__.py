"""The NVMe tier: a crash-safe zarr v3 store of tensors."""

from __future__ import annotations

from tierswap.store.layout import ArrayInfo
from tierswap.store.swapstore import SwapStore

__all__ = ["ArrayInfo", "SwapStore"]
