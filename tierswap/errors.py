"""One exception tree for tierswap.

Every error subclasses :class:`TierswapError` and, where one fits, the matching builtin, so
``except KeyError`` or ``except OSError`` in user code keeps working. Messages name the offending
value and say how to fix it.
"""

from __future__ import annotations

import errno

__all__ = [
    "BenchmarkError",
    "BudgetError",
    "ConfigError",
    "CorruptionError",
    "FailedStepError",
    "GradientOffloadedError",
    "InconsistentResumeError",
    "InvalidKeyError",
    "InvalidTensorError",
    "KeyNotFoundError",
    "NoCommitError",
    "OutOfSpaceError",
    "PinnedError",
    "ReadOnlyError",
    "SavepointError",
    "RegionError",
    "SnapshotExistsError",
    "StoreClosedError",
    "StoreLockedError",
    "TierswapError",
    "WorldSizeError",
]


class TierswapError(Exception):
    """Base class of every error tierswap raises on purpose."""


class ConfigError(TierswapError, ValueError, TypeError):
    """A setting is invalid (a size that does not parse, a budget below the minimum, an object
    of the wrong kind, ...): a ``ValueError`` and a ``TypeError``, so either clause catches it."""


class BudgetError(ConfigError):
    """A tier's byte budget cannot hold what was asked of it."""


class WorldSizeError(ConfigError):
    """A swap folder was committed by a torch.distributed run with another world size or rank."""


class InconsistentResumeError(TierswapError, RuntimeError):
    """The ranks of a torch.distributed run resumed swap folders committed at different steps."""


class InvalidKeyError(TierswapError, ValueError):
    """A key is malformed or could escape the store's folder."""


class KeyNotFoundError(TierswapError, KeyError):
    """A key is not in the store or cache."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class InvalidTensorError(TierswapError, ValueError):
    """A tensor (or an ``out=`` buffer) cannot be stored or filled as asked."""


class RegionError(TierswapError, IndexError):
    """A region (element range) that does not lie inside the stored tensor."""


class CorruptionError(TierswapError, OSError):
    """Stored bytes or metadata fail their checksum or do not parse."""


class OutOfSpaceError(TierswapError, OSError):
    """The disk is full. The last commit is intact; free space and retry."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.args[1])


class StoreLockedError(TierswapError, RuntimeError):
    """Another writer holds the store's lock."""


class PinnedError(TierswapError, RuntimeError):
    """A cached item is pinned and cannot be evicted, moved or replaced until it is unpinned."""


class ReadOnlyError(TierswapError, PermissionError):
    """A write was attempted on a store opened with ``mode="r"``."""


class StoreClosedError(TierswapError, RuntimeError):
    """The store or cache was used after ``close()``."""


class BenchmarkError(TierswapError, RuntimeError):
    """A benchmark engine or baseline tool (fio, dd) failed on the benchmark folder."""


class SnapshotExistsError(TierswapError, FileExistsError):
    """A snapshot's destination already holds files; snapshots go into a new or empty folder."""


class FailedStepError(TierswapError, RuntimeError):
    """A step failed part-way (its error was raised then), so the optimizer's state mixes two
    steps; ``commit()`` and ``snapshot()`` refuse to keep it until a whole state is loaded."""


class NoCommitError(TierswapError, RuntimeError):
    """A snapshot was asked of a store whose committed state is not on disk: it was never
    committed, or it is a scratch store with changes made since its last commit."""


class SavepointError(TierswapError, RuntimeError):
    """A store rollback that cannot return to the savepoint: none is set, or the key was put,
    created or deleted since (only region writes keep the versions they replace)."""


class GradientOffloadedError(TierswapError, RuntimeError):
    """Code read or changed the gradient of a parameter that ``offload_parameters`` keeps in
    the swap space (an in-place edit, a read of its values; clipping and a ``GradScaler``'s
    unscale are answered from the swap space): it would see nothing, so it is stopped."""
