"""Where a streamed parameter's values and kept gradient are in the swap space, and the moves
between there and memory.

A parameter's slot is cut into segments across the layout's slices. A segment of a slice the
policy keeps resident (host or device tier) is copied from that slice's tensors; any other is
read from the store by a job of the optimizer's :class:`~tierswap.pipeline.Pipeline` (one job
per segment, within the host budget) or written behind to it.

Values go to a parameter on a GPU through the engine's transfer layer: its memory is allocated
for uploads (:class:`~tierswap.optim.stream._storage.ParameterMemory`) and each segment is
copied on the upload stream, so the copy runs while the kernels of the modules before it still
compute; the compute stream waits for it before the module's kernels (the calling thread waits
only until the copy has read the host buffer, which then goes back to the pool). A module
uploaded ahead of its use (:func:`read_into` with ``later``) waits for neither: its host
buffers are lent by the pipeline until each copy has read them, and the compute stream waits
when the module runs (:func:`ready_all`).

Private to :mod:`tierswap.optim.stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierswap.engine import ToDevice, transfers_for
from tierswap.io import footprint
from tierswap.optim.plan import Layout, Segment, Slot, master_dtype
from tierswap.pipeline import Job, Pipeline, Region

__all__ = [
    "empty_for_upload",
    "grad_room",
    "keep_grad",
    "keep_values",
    "landed",
    "read_into",
    "read_job",
    "ready_all",
    "segments",
    "uploads_overlap",
]


def segments(layout: Layout, slot: Slot) -> list[tuple[int, Segment]]:
    """The segments of ``slot``, each with the index of the slice that holds it."""
    return [
        (piece.index, seg)
        for piece in layout.slices_of[slot.index]
        for seg in piece.segments
        if seg.slot is slot
    ]


def read_job(slot: Slot, seg: Segment, *, grad: bool = False) -> Job:
    """The read of ``seg``'s master or kept gradient (a job of the pipeline, named apart
    from the slices')."""
    region = _region(slot, seg, grad=grad)
    dtype = slot.param.dtype if grad or slot.remainder else master_dtype(slot.param)
    name = ("grad" if grad else "param", slot.index, seg.start)
    return Job(name, (region,), footprint(region.numel * dtype.itemsize))


def keep_grad(pipeline: Pipeline, layout: Layout, slot: Slot, grad: torch.Tensor) -> None:
    """Put ``grad`` where the step reads it: into a resident slice's tensors, or behind the
    caller into the store (from pooled host buffers, within the host budget)."""
    _keep(pipeline, layout, slot, grad, grad=True)


def grad_room(layout: Layout, slots: list[Slot]) -> int:
    """Host bytes the largest write-behind of :func:`keep_grad` takes for ``slots``: one
    segment's gradient, in a pooled buffer."""
    return max(
        (
            footprint(seg.numel * slot.param.element_size())
            for slot in slots
            for _, seg in segments(layout, slot)
        ),
        default=0,
    )


def keep_values(pipeline: Pipeline, layout: Layout, slot: Slot, values: torch.Tensor) -> None:
    """Put a parameter's ``values`` (edited outside the optimizer) where its uses and the step
    read them, as :func:`keep_grad` does a gradient: its master (cast), or, beside a
    remainder, the stored parameter (the remainder stays, as in memory)."""
    _keep(pipeline, layout, slot, values, grad=False)


def _keep(
    pipeline: Pipeline, layout: Layout, slot: Slot, tensor: torch.Tensor, *, grad: bool
) -> None:
    flat = tensor.reshape(-1)
    for piece, seg in segments(layout, slot):
        region = _region(slot, seg, grad=grad)
        kept = pipeline.resident(piece)
        if kept is not None:
            kept[region].copy_(flat[seg.start : seg.stop])
            if not grad:  # a value the store lacks (a gradient is not state: none rolls it back)
                pipeline.touch(piece)
        else:  # a segment at a time: the room the layout keeps for one slice in flight
            # (a read of it started ahead is stale now: the pipeline drops it)
            pipeline.write_behind({region: flat[seg.start : seg.stop]})


def empty_for_upload(like: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``like``'s shape, dtype and device for :func:`read_into` to fill (on
    a GPU from the upload stream's pool, as a parameter's memory)."""
    with transfers_for(like.device).allocating():
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def read_into(
    pipeline: Pipeline,
    layout: Layout,
    targets: dict[int, torch.Tensor],
    ahead: set[Any],
    *,
    grad: bool = False,
    later: list[ToDevice] | None = None,
) -> tuple[int, int]:
    """Fill each flat tensor of ``targets`` (slot index -> tensor; on a GPU, memory allocated
    for uploads: ``ParameterMemory.allocate``, :func:`empty_for_upload`) with that slot's
    master (or, with ``grad``, its kept gradient): copied from the resident slices, read from the
    store for the others (the reads named in ``ahead``, started ahead, are consumed: their
    names leave it). Bytes copied, bytes read.

    With ``later`` (a GPU's parameters uploaded ahead of their module, every read landed:
    :func:`landed`) nothing waits: the copies are appended to ``later``, which the caller makes
    ready (:func:`ready_all`) before the values are used, and each read's host buffer goes back
    to the pipeline once its copy has read it."""
    jobs: list[Job] = []
    into: dict[Any, torch.Tensor] = {}
    copied = 0
    for index, target in targets.items():
        slot = layout.slots[index]
        for piece, seg in segments(layout, slot):
            kept = pipeline.resident(piece)
            if kept is not None:
                value = kept[_region(slot, seg, grad=grad)]
                _fill(target[seg.start : seg.stop], value, later)
                copied += value.numel() * value.element_size()
            else:
                jobs.append(read_job(slot, seg, grad=grad))
                into[jobs[-1].name] = target[seg.start : seg.stop]
    ahead.difference_update(into)
    fetched = sum(t.numel() * t.element_size() for t in into.values())
    if later is not None:
        _lend_into(pipeline, jobs, into, later)
        return copied, fetched

    def work(job: Job, tensors: dict[Region, torch.Tensor]) -> dict[Region, torch.Tensor]:
        _fill(into[job.name], tensors[job.reads[0]], None)
        return {}

    with torch.no_grad():
        pipeline.run(jobs, work)
    return copied, fetched


def _fill(target: torch.Tensor, value: torch.Tensor, later: list[ToDevice] | None) -> None:
    """Copy host ``value`` into ``target`` (memory allocated for uploads) through the transfer
    layer of ``target``'s device (on the CPU a plain copy); the compute stream waits for the
    copy, this thread only until the copy has read ``value``. With ``later``: neither waits,
    the copy is appended to it."""
    transfers = transfers_for(target.device)
    copy = transfers.to_device(value, target, upload_memory=True)
    if later is not None:
        later.append(copy)
        return
    transfers.ready(copy)
    copy.done.result()


def _lend_into(
    pipeline: Pipeline, jobs: list[Job], into: dict[Any, torch.Tensor], later: list[ToDevice]
) -> None:
    """Copy each job's read (landed) into its tensor of ``into`` without waiting (the copies
    appended to ``later``), its host buffers lent until the copy has read them. On a failure
    the reads not yet lent are dropped too: nothing is left holding the host budget."""
    for position, job in enumerate(jobs):
        give_back: Callable[[], None] | None = None
        try:
            tensors, give_back = pipeline.lend(job)
            _fill(into[job.name], tensors[job.reads[0]], later)
        except BaseException:
            if give_back is not None:
                give_back()
            pipeline.release(j.name for j in jobs[position + 1 :])
            raise
        _call_when_done(later[-1], give_back)


def _call_when_done(copy: ToDevice, then: Callable[[], None]) -> None:
    """Call ``then`` once ``copy`` has read its source (on whichever thread completes it)."""
    copy.done.add_done_callback(lambda _: then())


def uploads_overlap(param: torch.Tensor) -> bool:
    """Whether copies to ``param``'s device run beside its compute (a GPU's side stream), so
    that uploading a module's parameters ahead of its use hides them behind the module
    before; on the CPU nothing is copied, and reading ahead would only take memory."""
    return transfers_for(param.device).moves


def landed(pipeline: Pipeline, layout: Layout, slot: Slot) -> bool:
    """Whether every segment of ``slot``'s master is in memory now (resident, or read ahead
    and landed): :func:`read_into` with ``later`` would wait for no read."""
    return all(
        pipeline.resident_tier(piece) is not None or pipeline.landed(read_job(slot, seg).name)
        for piece, seg in segments(layout, slot)
    )


def ready_all(copies: list[ToDevice]) -> None:
    """Order the compute work queued from now on after each of ``copies`` (made by
    :func:`read_into` with ``later``)."""
    for copy in copies:
        transfers_for(copy.device_tensor.device).ready(copy)


def _region(slot: Slot, seg: Segment, *, grad: bool) -> Region:
    """Where ``seg``'s kept gradient or values are stored: the master, or, beside a
    remainder, the parameter itself (2 bytes for bf16)."""
    if grad:
        return Region(slot.grad_key, seg.start, seg.stop)
    return Region(slot.param_key if slot.remainder else slot.master_key, seg.start, seg.stop)
