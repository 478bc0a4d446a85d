"""The arrays every slot has from the start, and the writes of its master and parameter."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tierswap.optim.persist._parts import OptimizerParts
from tierswap.optim.plan import Segment, Slot, flat, master_dtype
from tierswap.pipeline import Region

__all__ = [
    "base_arrays",
    "create_arrays",
    "master_of",
    "read_master",
    "write_master",
    "write_params",
]


def base_arrays(slot: Slot) -> list[tuple[str, torch.dtype]]:
    """The arrays every slot has from the start (key, dtype; in the parameter's shape): its
    master (fp32, or the int16 remainder), its committed copy of the parameter, and a streamed
    parameter's gradient."""
    arrays = []
    if slot.has_master:
        arrays.append(
            (slot.master_key, torch.int16 if slot.remainder else master_dtype(slot.param))
        )
    if slot.persists_param:
        arrays.append((slot.param_key, slot.param.dtype))
    if slot.keeps_grad:
        arrays.append((slot.grad_key, slot.param.dtype))
    return arrays


def master_of(slot: Slot, values: torch.Tensor) -> torch.Tensor:
    """The stored master (CPU) of a slot whose master is the parameter ``values``: its fp32
    cast, or a remainder of zeros (``split(param.float())`` leaves nothing over)."""
    if slot.remainder:
        return torch.zeros(values.shape, dtype=torch.int16)
    return values.detach().to("cpu", master_dtype(slot.param))


def create_arrays(
    parts: OptimizerParts, slots: list[Slot], *, unwritten: Iterable[Slot] = ()
) -> None:
    """Create the arrays of new ``slots`` (those the store does not hold yet) and write their
    masters (or params), except those of ``unwritten`` (parameters with no values yet, whose
    masters :func:`write_master` writes once they are initialized)."""
    backend = parts.backend
    for slot in slots:
        for key, dtype in base_arrays(slot):
            if key not in backend.known:
                backend.create(key, tuple(slot.local.shape), dtype)
    skipped = {slot.index for slot in unwritten}
    write_params(parts, [slot for slot in slots if slot.index not in skipped], masters=True)


def write_master(parts: OptimizerParts, slot: Slot) -> None:
    """Write the master of a streamed ``slot`` from its parameter's values (and the values
    themselves, beside a remainder), whole: every segment, in one batch of region writes."""
    values = flat(slot.param)
    writes: dict[Region, torch.Tensor] = {}
    for piece in parts.layout.slices:
        for seg in piece.segments:
            if seg.slot is slot:
                part = values[seg.start : seg.stop]
                writes[Region(slot.master_key, seg.start, seg.stop)] = master_of(slot, part)
                if slot.persists_param:
                    writes[Region(slot.param_key, seg.start, seg.stop)] = part.detach().cpu()
    parts.backend.put_regions(writes)


def read_master(parts: OptimizerParts, slot: Slot) -> torch.Tensor:
    """A CPU copy of a streamed ``slot``'s stored values, whole and flat: its master, or the
    stored parameter beside a remainder."""
    parts.backend.pipeline.flush()
    key = slot.param_key if slot.remainder else slot.master_key
    return parts.backend.read_region(Region(key, 0, slot.param.numel()))


def write_params(parts: OptimizerParts, slots: list[Slot], *, masters: bool) -> None:
    """Write ``slots``' params that have no master (the committed copy) and, with
    ``masters``, the masters of the others (cast from the params); a slice at a time, so
    the transient stays within one slice."""
    chosen = {slot.index for slot in slots}
    for piece in parts.layout.slices:
        writes: dict[Region, torch.Tensor] = {}
        for seg in piece.segments:
            slot = seg.slot
            if slot.index not in chosen:
                continue
            values = flat(slot.param)[seg.start : seg.stop]
            if slot.has_master and masters:
                writes[Region(slot.master_key, seg.start, seg.stop)] = master_of(slot, values)
            if slot.persists_param:
                writes[Region(slot.param_key, seg.start, seg.stop)] = values.detach().cpu()
        parts.backend.put_regions(writes)


def restore_params(parts: OptimizerParts, segments: Iterable[Segment]) -> None:
    """Put back the pre-step value of each segment of a parameter after a rollback
    (:meth:`~tierswap.optim.persist.StateBackend.roll_back`): from the copy a speculative
    step wrote under its :attr:`~tierswap.optim.plan.Slot.param_key` (a parameter the store
    keeps), else from its rolled-back master."""
    for seg in segments:
        slot = seg.slot
        key = slot.param_key if slot.persists_param else slot.master_key
        value = parts.backend.read_region(Region(key, seg.start, seg.stop))
        with torch.no_grad():
            flat(slot.param)[seg.start : seg.stop].copy_(value)
