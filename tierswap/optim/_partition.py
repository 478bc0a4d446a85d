"""Parameter slots, state-size probing and partitioning.

A *slot* is one parameter the optimizer owns; a *partition* is a run of slots stepped together.
Partitions follow the schedule order, which is the reverse of registration order (the order
gradients usually become final during backward), so the state read first in ``step()`` is the
state whose gradients arrived first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tierswap.config import ALIGN, format_size, round_up
from tierswap.errors import ConfigError

__all__ = ["Partition", "Slot", "master_dtype", "partition_slots", "probe_state_itemsizes"]

#: Low-precision parameter dtypes that get an fp32 master copy.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2, tensor parallel); any other tensor as is.

    The shard shares storage with the DTensor, so stepping it steps this rank's part of the
    parameter with the same per-element math torch runs on the DTensor.
    """
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def master_dtype(param: torch.Tensor) -> torch.dtype:
    """dtype of the master weights and state kept for ``param`` (fp32 for fp16/bf16 params)."""
    return torch.float32 if param.dtype in _LOW_PRECISION else param.dtype


@dataclasses.dataclass
class Slot:
    """One parameter: its global index (the ``p<i>`` in keys), group, and bookkeeping.

    ``has_master`` is true when the step runs on a separate copy of the parameter (a fp32 master
    of a low-precision parameter, or a host copy of a parameter that lives on another device).
    ``state_itemsizes`` lists the element size of each per-element state tensor, probed from the
    optimizer class (``[4, 4]`` for AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32).
    """

    index: int
    param: torch.Tensor
    group: int
    has_master: bool
    state_itemsizes: tuple[int, ...]

    @property
    def local(self) -> torch.Tensor:
        """The tensor this rank steps: the parameter, or its local shard for a DTensor."""
        return local_tensor(self.param)

    @property
    def prefix(self) -> str:
        return f"p{self.index}"

    @property
    def master_key(self) -> str:
        return f"p{self.index}/master"

    @property
    def param_key(self) -> str:
        return f"p{self.index}/param"

    @property
    def state_bytes(self) -> int:
        """Cache footprint of the state: each tensor occupies whole 4 KiB pages."""
        numel = self.local.numel()
        return sum(_footprint(numel * size) for size in self.state_itemsizes)

    @property
    def master_bytes(self) -> int:
        if not self.has_master:
            return 0
        return _footprint(self.local.numel() * master_dtype(self.param).itemsize)

    @property
    def working_set(self) -> int:
        """Bytes the cache holds for this slot while it steps: state plus master."""
        return self.state_bytes + self.master_bytes


def _footprint(nbytes: int) -> int:
    return max(round_up(nbytes, ALIGN), ALIGN)


@dataclasses.dataclass
class Partition:
    """Slots stepped together; ``index`` is the position in the schedule."""

    index: int
    slots: list[Slot]

    @property
    def working_set(self) -> int:
        return sum(s.working_set for s in self.slots)


def probe_state_itemsizes(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> tuple[int, ...]:
    """Element sizes of the per-element state tensors this group keeps for a ``dtype`` param.

    Steps a throw-away two-element parameter once with the group's hyper-parameters and lists
    the item sizes of the state tensors shaped like it (``exp_avg``, ``momentum_buffer``, ...).
    Scalars such as ``step`` are ignored: they stay in RAM.
    """
    hyper = {k: v for k, v in group.items() if k != "params"}
    for key in ("foreach", "fused", "capturable"):  # the probe runs on the CPU, plainly
        hyper.pop(key, None)
    if isinstance(hyper.get("lr"), torch.Tensor):
        hyper["lr"] = float(hyper["lr"])
    probe = torch.zeros(2, dtype=dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    inner = optimizer_class([{"params": [probe], **hyper}])
    inner.step()
    state = inner.state.get(probe, {})
    return tuple(
        v.element_size() for v in state.values() if torch.is_tensor(v) and v.shape == probe.shape
    )


def partition_slots(slots: Sequence[Slot], target_bytes: int) -> list[Partition]:
    """Pack ``slots`` (already in schedule order) into partitions of about ``target_bytes``.

    A slot never splits: one larger than the target gets a partition of its own.
    """
    partitions: list[Partition] = []
    current: list[Slot] = []
    size = 0
    for slot in slots:
        if current and size + slot.working_set > target_bytes:
            partitions.append(Partition(len(partitions), current))
            current, size = [], 0
        current.append(slot)
        size += slot.working_set
    if current:
        partitions.append(Partition(len(partitions), current))
    return partitions


def check_budget(partitions: Sequence[Partition], budget: int, name: str) -> None:
    """Raise :class:`ConfigError` when one partition's working set exceeds ``budget``."""
    largest = max((p.working_set for p in partitions), default=0)
    if largest > budget:
        raise ConfigError(
            f"{name}={format_size(budget)} ({budget} bytes) is below the working set of the "
            f"largest partition; the minimum is {format_size(largest)} ({largest} bytes): "
            f"raise {name} to at least {largest}"
        )
