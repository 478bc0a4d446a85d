"""Parameter slots, state-size probing and slicing.

A *slot* is one parameter the optimizer owns; a *slice* is a fixed-size byte range of the
flattened parameters stepped as one unit: a large parameter spans several slices, small ones
share one, so the working set never depends on the largest parameter. Slices follow the schedule
order, the reverse of registration order (the order gradients usually become final during
backward), so the state read first in ``step()`` is the state whose gradients arrived first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tierswap.config import ALIGN, format_size, round_up
from tierswap.errors import ConfigError
from tierswap.optim._probe import StateShapes

__all__ = [
    "WHOLE_TEMPORARIES",
    "Segment",
    "Slice",
    "Slot",
    "check_budget",
    "master_dtype",
    "plan_slices",
]

#: Transient bytes of stepping a whole parameter, in multiples of its fp32 size: Muon's
#: Newton-Schulz holds the nesterov update (fp32), bf16 copies of the matrix and square
#: products of its smaller side, about five fp32 copies in all; Adafactor needs fewer.
WHOLE_TEMPORARIES = 5

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
    """One parameter: its global index, name and key, group, and bookkeeping.

    ``has_master`` is true when the step runs on a separate copy of the parameter (a fp32 master
    of a low-precision parameter, or a host copy of a parameter that lives on another device).
    ``state_itemsizes`` lists the element size of each per-element state tensor, probed from the
    optimizer class (``[4, 4]`` for AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32).
    ``whole_state`` is set for a parameter that must step whole (its optimizer's math spans the
    parameter, as Muon's and Adafactor's do): its state tensors' shapes and element sizes.
    """

    index: int
    param: torch.Tensor
    group: int
    has_master: bool
    state_itemsizes: tuple[int, ...]
    name: str | None = None  # the parameter's name, when the optimizer was given names
    key: str = ""  # the key segment of its arrays; "" means positional, ``p<index>``
    whole_state: StateShapes | None = None

    @property
    def whole(self) -> bool:
        """Slices hold this parameter whole: they never cut it."""
        return self.whole_state is not None

    @property
    def local(self) -> torch.Tensor:
        """The tensor this rank steps: the parameter, or its local shard for a DTensor."""
        return local_tensor(self.param)

    @property
    def prefix(self) -> str:
        """The first segment of the slot's keys: its escaped name, or ``p<index>``."""
        return self.key or f"p{self.index}"

    @property
    def master_key(self) -> str:
        return f"{self.prefix}/master"

    @property
    def param_key(self) -> str:
        return f"{self.prefix}/param"

    @property
    def state_bytes(self) -> int:
        """Cache footprint of the state: each tensor occupies whole 4 KiB pages."""
        if self.whole_state is not None:
            return sum(_footprint(math.prod(s) * size) for s, size in self.whole_state.values())
        numel = self.local.numel()
        return sum(_footprint(numel * size) for size in self.state_itemsizes)

    @property
    def master_bytes(self) -> int:
        if not self.has_master:
            return 0
        return _footprint(self.local.numel() * master_dtype(self.param).itemsize)

    @property
    def working_set(self) -> int:
        """Bytes held for this slot while it steps whole: state plus master."""
        return self.state_bytes + self.master_bytes

    @property
    def bytes_per_element(self) -> int:
        """Host bytes per element while stepping: state, and master plus fp32 gradient."""
        master = 2 * master_dtype(self.param).itemsize if self.has_master else 0
        return sum(self.state_itemsizes) + master

    @property
    def min_itemsize(self) -> int:
        """Smallest element size among the slot's stored arrays (state, master, param)."""
        return min((*self.state_itemsizes, master_dtype(self.param).itemsize))


def _footprint(nbytes: int) -> int:
    return max(round_up(nbytes, ALIGN), ALIGN)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of one slot's flattened (local) parameter."""

    slot: Slot
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def working_set(self) -> int:
        """Host bytes of this segment's buffers: each state and master region in whole pages,
        plus the transient fp32 gradient of a master."""
        numel = self.numel
        if numel == 0:  # e.g. an empty FSDP shard: stepped for its counters, no buffers
            return 0
        if self.slot.whole:
            master = 2 * self.slot.master_bytes  # master, gradient cast
            return self.slot.state_bytes + master + _footprint(numel * 4) * WHOLE_TEMPORARIES
        sizes = list(self.slot.state_itemsizes)
        if self.slot.has_master:
            sizes += [master_dtype(self.slot.param).itemsize] * 2  # master, gradient cast
        return sum(_footprint(numel * size) for size in sizes)


@dataclasses.dataclass
class Slice:
    """A fixed-size byte range of the flattened parameters, stepped as one unit.

    A large parameter spans several slices, small ones share one; ``index`` is the position in
    the schedule.
    """

    index: int
    segments: list[Segment]

    @property
    def working_set(self) -> int:
        return sum(seg.working_set for seg in self.segments)

    @property
    def slots(self) -> list[Slot]:
        return [seg.slot for seg in self.segments]


def plan_slices(slots: Sequence[Slot], target_bytes: int, chunk_bytes: int) -> list[Slice]:
    """Cut ``slots`` (already in schedule order) into slices of about ``target_bytes``.

    A parameter splits only at multiples of ``chunk_bytes`` in every one of its stored arrays,
    so each slice is a run of whole chunks on disk (read and written without touching its
    neighbours). A single such unit larger than the target gets a slice of its own. A
    ``whole`` parameter is never cut: it joins the current slice when it fits there, else it
    starts a new one.
    """
    slices: list[Slice] = []
    current: list[Segment] = []
    room = target_bytes
    for slot in slots:
        if slot.whole:
            segment = Segment(slot, 0, slot.local.numel())
            if current and segment.working_set > room:
                slices.append(Slice(len(slices), current))
                current, room = [], target_bytes
            current.append(segment)
            room -= segment.working_set
            if room <= 0:
                slices.append(Slice(len(slices), current))
                current, room = [], target_bytes
            continue
        numel, per_element = slot.local.numel(), max(slot.bytes_per_element, 1)
        unit = max(chunk_bytes // slot.min_itemsize, 1)
        position = 0
        while position < numel or (numel == 0 and position == 0):
            rest = numel - position
            take = rest if rest * per_element <= room else (room // per_element) // unit * unit
            if take == 0 and rest:
                if current:
                    slices.append(Slice(len(slices), current))
                    current, room = [], target_bytes
                    continue
                take = min(unit, rest)
            segment = Segment(slot, position, position + take)
            current.append(segment)
            room -= segment.working_set
            position += take
            if numel == 0:
                break
            if room <= 0:
                slices.append(Slice(len(slices), current))
                current, room = [], target_bytes
    if current:
        slices.append(Slice(len(slices), current))
    return slices


def check_budget(slices: Sequence[Slice], budget: int, name: str) -> None:
    """Raise :class:`ConfigError` when one slice's working set exceeds ``budget``; a parameter
    that steps whole and does not fit on its own is named."""
    largest = max((s.working_set for s in slices), default=0)
    if largest <= budget:
        return
    whole = [seg for piece in slices for seg in piece.segments if seg.slot.whole]
    too_big = max(whole, key=lambda seg: seg.working_set, default=None)
    if too_big is not None and too_big.working_set > budget:
        slot, need = too_big.slot, too_big.working_set
        raise ConfigError(
            f"{name}={format_size(budget)} ({budget} bytes) cannot hold parameter "
            f"{slot.name or slot.prefix!r} of shape {tuple(slot.local.shape)}, which its "
            f"optimizer steps whole; for its state, gradient and the step's temporaries the "
            f"minimum is {format_size(need)} ({need} bytes): raise {name} to at least {need}"
        )
    raise ConfigError(
        f"{name}={format_size(budget)} ({budget} bytes) is below the working set of the "
        f"largest slice; the minimum is {format_size(largest)} ({largest} bytes): "
        f"raise {name} to at least {largest}"
    )
