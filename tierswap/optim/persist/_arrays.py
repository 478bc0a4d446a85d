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
    "write_lagging_masters",
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


def _master_source(slot: Slot, values: torch.Tensor) -> torch.Tensor:
    """What the write of a slot's master copies (and casts) into its reserved buffer: the
    parameter ``values`` (1-D), or, for a remainder, zeros that take no memory."""
    if slot.remainder:
        return torch.zeros((), dtype=torch.int16).expand(values.numel())
    return values.detach()


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
    themselves, beside a remainder), whole (:func:`write_params`)."""
    write_params(parts, [slot], masters=True)


def write_lagging_masters(
    parts: OptimizerParts, indices: Iterable[int] | None = None
) -> dict[int, set[Region]]:
    """Write the master regions whose stored values lag the values their streamed parameter
    holds (:attr:`~tierswap.optim.persist.StepState.unwritten_masters`; of slots ``indices``,
    or all), from the parameters, a region at a time behind the caller (the pipeline's
    write-behind copies them first: the parameter may let its values go on return; a commit
    waits for them). Only these parameters hold the newest values: none may let them go
    before this. Returns the regions written, by slot."""
    lagging = parts.state.unwritten_masters
    chosen = list(lagging) if indices is None else [i for i in indices if i in lagging]
    written = {index: lagging.pop(index) for index in chosen}
    pipeline = parts.backend.pipeline
    with torch.no_grad():
        for index, regions in written.items():
            values = flat(parts.layout.slots[index].param.detach())
            for region in sorted(regions, key=lambda r: r.start):
                pipeline.write_behind({region: values[region.start : region.stop]})
    return written


def read_master(parts: OptimizerParts, slot: Slot) -> torch.Tensor:
    """A CPU copy of a streamed ``slot``'s stored values, whole and flat: its master, or the
    stored parameter beside a remainder."""
    parts.backend.pipeline.flush()
    key = slot.param_key if slot.remainder else slot.master_key
    return parts.backend.read_region(Region(key, 0, slot.param.numel()))


def write_params(parts: OptimizerParts, slots: list[Slot], *, masters: bool) -> None:
    """Write ``slots``' params that the store keeps (no master, or beside a remainder) and,
    with ``masters``, their masters (cast from the params), and wait; a slice at a time. A
    param is written straight from its memory (no copy on the CPU: a commit may find the host
    budget full of resident slices); a master is cast into pooled buffers reserved in the host
    budget (the pipeline's write-behind), so no transient lies outside the ledger."""
    chosen = {slot.index for slot in slots}
    pipeline = parts.backend.pipeline
    direct = []
    try:
        for piece in parts.layout.slices:
            cast: dict[Region, torch.Tensor] = {}
            params: dict[Region, torch.Tensor] = {}
            for seg in piece.segments:
                slot, start, stop = seg.slot, seg.start, seg.stop
                if slot.index not in chosen:
                    continue
                values = flat(slot.param)[start:stop].detach()
                if slot.has_master and masters:
                    cast[Region(slot.master_key, start, stop)] = _master_source(slot, values)
                if slot.persists_param:
                    params[Region(slot.param_key, start, stop)] = values
            pipeline.write_behind(cast)
            if params:
                direct.append(pipeline.write(params))
        pipeline.drain()
    finally:
        for written in direct:
            written.exception()  # wait: the writes read the parameters' memory
    for written in direct:
        written.result()


def restore_params(parts: OptimizerParts, segments: Iterable[Segment]) -> None:
    """Put back the pre-step value of each segment of a parameter after a rollback
    (:meth:`~tierswap.optim.persist.StateBackend.roll_back`): from the copy a speculative
    step wrote under its :attr:`~tierswap.optim.plan.Slot.param_key` (a parameter the store
    keeps), else from its rolled-back master. A streamed parameter's values are its stored
    ones, which the rollback restored: only one that keeps them in memory between uses gets
    them back (through ``.data``: not an edit of it)."""
    for seg in segments:
        slot = seg.slot
        if slot.streamed and slot.param.untyped_storage().nbytes() == 0:
            continue
        key = slot.restore_key
        value = parts.backend.read_region(Region(key, seg.start, seg.stop))
        with torch.no_grad():
            flat(slot.param.data if slot.streamed else slot.param)[seg.start : seg.stop].copy_(
                value
            )
