"""Parameter slots, state-size probing and slicing.

A *slot* is one parameter the optimizer owns; a *slice* is a fixed-size byte range of the
flattened parameters stepped as one unit: a large parameter spans several slices, small ones
share one, so the working set never depends on the largest parameter. Slices follow the schedule
order, the reverse of registration order (the order gradients usually become final during
backward), so the state read first in ``step()`` is the state whose gradients arrived first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierswap.config import ALIGN, format_size, round_up
from tierswap.errors import ConfigError

__all__ = [
    "Segment",
    "Slice",
    "Slot",
    "check_budget",
    "check_elementwise",
    "master_dtype",
    "plan_slices",
    "probe_state_itemsizes",
]

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
    """

    index: int
    param: torch.Tensor
    group: int
    has_master: bool
    state_itemsizes: tuple[int, ...]
    name: str | None = None  # the parameter's name, when the optimizer was given names
    key: str = ""  # the key segment of its arrays; "" means positional, ``p<index>``

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


def probe_state_itemsizes(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> tuple[int, ...]:
    """Element sizes of the per-element state tensors this group keeps for a ``dtype`` param.

    Steps a throw-away two-element parameter once with the group's hyper-parameters and lists
    the item sizes of the state tensors shaped like it (``exp_avg``, ``momentum_buffer``, ...).
    Scalars such as ``step`` are ignored: they stay in RAM.
    """
    hyper = _probe_hyper(group)
    probe = torch.zeros(2, dtype=dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    inner = _make(optimizer_class, [{"params": [probe], **hyper}])
    inner.step()
    state = inner.state.get(probe, {})
    return tuple(
        v.element_size() for v in state.values() if torch.is_tensor(v) and v.shape == probe.shape
    )


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
    neighbours). A single such unit larger than the target gets a slice of its own.
    """
    slices: list[Slice] = []
    current: list[Segment] = []
    room = target_bytes
    for slot in slots:
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


def check_elementwise(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype
) -> None:
    """Raise :class:`ConfigError` unless stepping flat pieces of a parameter is bitwise equal to
    stepping it whole with ``optimizer_class`` (true of every optimizer whose math is per
    element; not of factored or matrix ones such as Adafactor or Muon)."""
    hyper = _probe_hyper(group)
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(8, 16, generator=gen).to(dtype)
    grads = [torch.randn(8, 16, generator=gen).to(dtype) for _ in range(2)]
    pieces = whole.clone()
    flat = pieces.view(-1)
    try:
        ref = _make(optimizer_class, [{"params": [whole], **hyper}])
        split = _make(optimizer_class, [{"params": [flat[:64], flat[64:]], **hyper}])
        for grad in grads:
            whole.grad = grad.clone()
            flat_grad = grad.reshape(-1)
            for piece, start in zip(split.param_groups[0]["params"], (0, 64), strict=True):
                piece.grad = flat_grad[start : start + 64].clone()
            ref.step()
            split.step()
        same = torch.equal(whole, pieces)
    except Exception as exc:  # e.g. an optimizer that needs 2-D parameters
        raise ConfigError(
            f"{optimizer_class.__name__} cannot step slices of a parameter ({exc}); tierswap "
            "swaps optimizers whose math is per element (AdamW, SGD, Adagrad, ...)"
        ) from exc
    if not same:
        raise ConfigError(
            f"{optimizer_class.__name__} does not give the same result on slices of a parameter "
            "as on the whole parameter (its math is not per element, e.g. factored statistics); "
            "tierswap swaps optimizers with per-element state (AdamW, SGD, Adagrad, ...)"
        )


def _probe_hyper(group: dict[str, Any]) -> dict[str, Any]:
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    for key in ("foreach", "fused", "capturable"):  # the probes run on the CPU, plainly
        hyper.pop(key, None)
    if isinstance(hyper.get("lr"), torch.Tensor):
        hyper["lr"] = float(hyper["lr"])
    return hyper


def check_budget(slices: Sequence[Slice], budget: int, name: str) -> None:
    """Raise :class:`ConfigError` when one slice's working set exceeds ``budget``."""
    largest = max((s.working_set for s in slices), default=0)
    if largest > budget:
        raise ConfigError(
            f"{name}={format_size(budget)} ({budget} bytes) is below the working set of the "
            f"largest slice; the minimum is {format_size(largest)} ({largest} bytes): "
            f"raise {name} to at least {largest}"
        )


def _make(
    optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """``optimizer_class(groups)``: subclasses give every hyper-parameter a default, which the
    base class's ``(params, defaults)`` signature does not say."""
    factory: Callable[..., torch.optim.Optimizer] = optimizer_class
    return factory(groups)
