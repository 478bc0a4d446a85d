"""The tier names every layer shares: a leaf module (it imports nothing from tierswap)."""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["DEVICE", "HOST", "MEMORY_TIERS", "NVME", "TierName"]

DEVICE: Final = "device"  # accelerator memory
HOST: Final = "host"  # page-aligned (pinned when CUDA is present) host memory
NVME: Final = "nvme"  # the store on disk

#: A memory tier: where a cache holds an item's bytes.
TierName = Literal["device", "host"]
MEMORY_TIERS: Final[tuple[TierName, ...]] = (DEVICE, HOST)
