"""torch.distributed support: per-rank swap folders, world-size and resume checks.

tierswap has no communication layer of its own. Under ``torch.distributed`` each rank owns the
optimizer state of its own parameters (``ZeroRedundancyOptimizer``) or of its local shards
(FSDP2 ``fully_shard``) and swaps it to its own folder ``swap_dir/rank-<r>`` (with a list of
folders, one per drive: ``<folder>/rank-<r>`` in each); torch moves the gradients and
parameters between ranks exactly as it does for an in-memory optimizer. A
``DTensor`` parameter is stepped and swapped through its local shard (``Slot.local``).

Every commit records the world size and rank that wrote it; resuming a folder with another
world size raises :class:`~tierswap.errors.WorldSizeError` instead of silently loading a shard
that belongs to another partitioning of the model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import torch

from tierswap.errors import InconsistentResumeError, WorldSizeError

__all__ = [
    "InconsistentResumeError",
    "WorldSizeError",
    "broadcast_owned_params",
    "check_resumed_steps",
    "check_same_step",
    "check_world",
    "rank_swap_dir",
    "world",
    "world_meta",
]


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when none is initialised."""
    if _distributed():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@overload
def rank_swap_dir(swap_dir: str | os.PathLike[str]) -> Path: ...  # type: ignore[overload-overlap]


@overload
def rank_swap_dir(swap_dir: Sequence[str | os.PathLike[str]]) -> list[Path]: ...


def rank_swap_dir(
    swap_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> Path | list[Path]:
    """The folder this process swaps to: ``swap_dir/rank-<r>`` inside a process group.

    The rank is the global rank of the default process group, so every process on every node
    gets its own folder, on the node's local disk when ``swap_dir`` is a local path. Outside
    ``torch.distributed`` it is ``swap_dir`` itself. A list of folders (one per drive) gives
    the list of ``<folder>/rank-<r>``.
    """
    if not isinstance(swap_dir, (str, os.PathLike)):
        return [rank_swap_dir(folder) for folder in swap_dir]
    path = Path(swap_dir)
    if _distributed():
        path = path / f"rank-{torch.distributed.get_rank()}"
    return path


def world_meta() -> dict[str, int]:
    """What a commit records about the process group: ``{"rank": r, "world_size": n}``."""
    rank, size = world()
    return {"rank": rank, "world_size": size}


def check_world(meta: dict[str, Any], path: str | Path) -> None:
    """Raise :class:`WorldSizeError` unless the commit ``meta`` was written by this rank and size.

    Commits made before world sizes were recorded count as a single process.
    """
    rank, size = world()
    saved_size = int(meta.get("world_size", 1))
    saved_rank = int(meta.get("rank", 0))
    if saved_size != size:
        raise WorldSizeError(
            f"swap_dir {str(path)!r} was committed by a run with world_size={saved_size} "
            f"(rank {saved_rank}) but this run has world_size={size}: each rank's folder holds "
            "only its own shard of the optimizer state. Resume with the same number of ranks "
            f"({saved_size}), or start a new swap_dir and load the state from a torch checkpoint"
        )
    if saved_rank != rank:
        raise WorldSizeError(
            f"swap_dir {str(path)!r} holds the state of rank {saved_rank} but this is rank "
            f"{rank}: point swap_dir at the parent folder (tierswap adds rank-<r> itself) and "
            "keep each rank on the node that holds its folder"
        )


def broadcast_owned_params(optimizer: Any) -> None:
    """After resuming under ``ZeroRedundancyOptimizer``, make every rank's replica whole again.

    Each rank's swap folder restores only the parameters that rank owns (its ZeRO partition);
    this broadcasts every parameter from its owner, as ZeRO does after each step. Call it on
    every rank, after constructing the ``ZeroRedundancyOptimizer`` with ``resume=True`` and
    before the first forward pass.
    """
    dist = torch.distributed
    group = optimizer.process_group
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owned = {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
    rank = dist.get_rank(group)
    owners = torch.tensor(
        [rank if id(p) in owned else 0 for p in params], dtype=torch.int64, device=params[0].device
    )
    dist.all_reduce(owners, group=group)  # exactly one rank owns each parameter
    with torch.no_grad():
        for param, owner in zip(params, owners.tolist(), strict=True):
            dist.broadcast(param.data, src=dist.get_global_rank(group, owner), group=group)


def _differing_steps(steps: int) -> str | None:
    """``"rank 0: 3, rank 1: 2"`` when the ranks' step counts differ, else ``None`` (a
    collective: ``all_gather_object`` over the default group)."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, int(steps))
    if len(set(gathered)) == 1:
        return None
    return ", ".join(f"rank {r}: {s}" for r, s in enumerate(gathered))


def check_same_step(steps: int, path: str | Path, what: str) -> None:
    """Raise :class:`InconsistentResumeError` unless every rank is at step ``steps`` before
    ``what`` (e.g. a snapshot: per-rank folders of one consistent step). A collective; a no-op
    outside ``torch.distributed``."""
    found = _differing_steps(steps) if _distributed() else None
    if found is not None:
        raise InconsistentResumeError(
            f"the ranks are at different steps ({found}; this is {str(path)!r}): a {what} of "
            "the ranks' folders would mix steps; call it on every rank after the same step()"
        )


def check_resumed_steps(steps: int, path: str | Path) -> None:
    """Raise :class:`InconsistentResumeError` unless every rank resumed the same step.

    Each rank commits its own folder at the end of its own ``step()``; a run killed between two
    ranks' commits leaves folders one step apart, which no rank can repair alone. A collective
    over the default process group (``all_gather_object``: every rank must call it, as every
    rank constructs its optimizer); a no-op outside ``torch.distributed``.
    """
    found = _differing_steps(steps) if _distributed() else None
    if found is not None:
        raise InconsistentResumeError(
            f"the ranks' swap folders hold different steps ({found}; this is {str(path)!r}): "
            "the run stopped between two ranks' commits, and no rank can step back or catch up "
            "alone. Load a torch checkpoint (e.g. torch.distributed.checkpoint) into a new "
            "swap_dir, or start again"
        )
