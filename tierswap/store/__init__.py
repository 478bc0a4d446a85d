"""The NVMe tier: a crash-safe zarr v3 store of tensors.

The names under ``__all__`` are the store's API for the rest of tierswap: other packages (the
pipeline, the cache, the optimizer, the integrations, the CLI) import them from
``tierswap.store``, never from its underscore modules (``make test`` checks this with
import-linter). ``SwapStore`` and ``ArrayInfo`` are also public (``tierswap.SwapStore``);
``SnapshotResult`` and ``is_shared`` are cited by the docs; the snapshot helpers serve the
optimizer's and the trainers' checkpoints.
"""

from __future__ import annotations

from tierswap.store._layout import ArrayInfo
from tierswap.store._snapshot import (
    Progress,
    SnapshotResult,
    check_apart,
    check_destination,
    is_shared,
    replace_with_snapshot,
    take_snapshot,
)
from tierswap.store.swapstore import StorePaths, SwapStore

__all__ = [
    "ArrayInfo",
    "Progress",
    "SnapshotResult",
    "StorePaths",
    "SwapStore",
    "check_apart",
    "check_destination",
    "is_shared",
    "replace_with_snapshot",
    "take_snapshot",
]
