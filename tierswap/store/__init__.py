"""The NVMe tier: a crash-safe zarr v3 store of tensors."""

from __future__ import annotations

from tierswap.store._layout import ArrayInfo
from tierswap.store._snapshot import SnapshotResult, is_shared
from tierswap.store.swapstore import SwapStore

__all__ = ["ArrayInfo", "SnapshotResult", "SwapStore", "is_shared"]
