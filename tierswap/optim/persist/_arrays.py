"""The arrays every slot has from the start, and the writes of its master and parameter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierswap.optim.plan import Layout, Slot, flat, master_dtype
from tierswap.pipeline import Region

if TYPE_CHECKING:
    from tierswap.optim.persist._backend import StateBackend

__all__ = ["base_arrays", "master_of", "write_params"]


def base_arrays(slot: Slot) -> list[tuple[str, torch.dtype]]:
    """The arrays every slot has from the start (key, dtype; in the parameter's shape): its
    master (fp32, or the int16 remainder) and its committed copy of the parameter."""
    arrays = []
    if slot.has_master:
        arrays.append(
            (slot.master_key, torch.int16 if slot.remainder else master_dtype(slot.param))
        )
    if slot.persists_param:
        arrays.append((slot.param_key, slot.param.dtype))
    return arrays


def master_of(slot: Slot, values: torch.Tensor) -> torch.Tensor:
    """The stored master (CPU) of a slot whose master is the parameter ``values``: its fp32
    cast, or a remainder of zeros (``split(param.float())`` leaves nothing over)."""
    if slot.remainder:
        return torch.zeros(values.shape, dtype=torch.int16)
    return values.detach().to("cpu", master_dtype(slot.param))


def write_params(
    backend: StateBackend, layout: Layout, slots: list[Slot], *, masters: bool
) -> None:
    """Write ``slots``' params that have no master (the committed copy) and, with
    ``masters``, the masters of the others (cast from the params); a slice at a time, so
    the transient stays within one slice."""
    chosen = {slot.index for slot in slots}
    for piece in layout.slices:
        writes: dict[Region, torch.Tensor] = {}
        for seg in piece.segments:
            slot, values = seg.slot, flat(seg.slot.param)[seg.start : seg.stop]
            if slot.index not in chosen:
                continue
            if slot.has_master and masters:
                writes[Region(slot.master_key, seg.start, seg.stop)] = master_of(slot, values)
            if slot.persists_param:
                writes[Region(slot.param_key, seg.start, seg.stop)] = values.detach().cpu()
        backend.put_regions(writes)
