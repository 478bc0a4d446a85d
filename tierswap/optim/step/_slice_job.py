"""What one slice's step reads and holds: its job in the optimizer's pipeline.

A slice's job names the regions its step reads (the state that exists, each master, the
gradients kept in the swap space), the host bytes it takes while in flight, the tier it stays
in between steps, and which masters need no read because a parameter holds their values.
:mod:`~tierswap.optim.step._slice_work` then steps the tensors the pipeline read for it. The
8-bit scales of a layout that holds them in host memory are one job of their own
(:func:`scales_job`), viewed by each slice (:func:`scales_views`).
"""

from __future__ import annotations

import math
from collections.abc import Container

import torch

from tierswap.io import footprint
from tierswap.optim.formats import num_blocks
from tierswap.optim.plan import Segment, Slice, Slot, master_dtype
from tierswap.pipeline import Job, Region
from tierswap.tiers import HOST, TierName

__all__ = [
    "SCALES_JOB",
    "scales_job",
    "scales_views",
    "segment_region",
    "slice_job",
    "slice_reads",
    "state_region",
    "state_regions",
    "unbuffered_masters",
    "valued_masters",
]


def slice_job(
    piece: Slice,
    state_names: dict[int, list[str]],
    placement: dict[int, TierName],
    *,
    scratch: bool,
    scales_held: bool = False,
    grads_held: Container[int] = (),
    live: Container[int] = (),
    masters_lag: bool = False,
) -> Job:
    """The pipeline job of ``piece``: its reads, its bytes, the tier it stays in between
    steps (if any), and, with ``scratch`` (a step on the CPU), its work buffers, which the
    pipeline keeps apart (one for all slices: the job's bytes leave them out). Elsewhere the
    step allocates its work tensors, and the job's bytes count them. With ``scales_held``
    (:attr:`~tierswap.optim.plan.Layout.held_scales`) the 8-bit scales of existing state
    are neither read nor counted: the work views them in :func:`scales_job`'s tensors
    (:func:`scales_views`). The kept gradients of the slots in ``grads_held`` are not read (its
    bytes still count them, unless no step ever reads them from the swap space:
    :attr:`~tierswap.optim.plan.Slot.grads_in_memory`): the step takes them from memory
    (:attr:`~tierswap.optim.plan.StepPlan.held`). ``live``: slots whose parameters will
    hold their values when the job runs, though they may not yet (:func:`valued_masters`).
    Those masters get buffers (the job's ``unread``) into which a write of them copies the
    values, unless ``masters_lag`` (a step on the CPU that writes no master its parameter
    holds: :attr:`~tierswap.optim.plan.StepPlan.unwritten`, no commit due): the step then
    steps the parameter in place and needs no buffer (:func:`unbuffered_masters`).

    A slice with a trainable parameter that has no state yet (its first step) steps with
    the state torch creates instead of decoded copies: that pass takes no share of the work
    buffer, its bytes count its own work tensors instead, and the slice becomes resident
    only from its next pass, when it holds what the layout planned for it (a slice holding a
    trainable parameter that never gets a gradient therefore keeps streaming)."""
    fresh = piece.scratch_bytes > 0 and any(
        seg.slot.param.requires_grad and not state_names.get(seg.slot.index)
        for seg in piece.segments
    )
    shared = scratch and not fresh  # else its work tensors are its own
    held = sum(seg.scales_bytes for seg in piece.segments if state_names.get(seg.slot.index))
    tier = None if fresh else placement.get(piece.index)
    # a resident slice keeps the regions of its gradients, into which they are kept
    in_memory = () if tier is not None else grads_held
    reads = slice_reads(piece, state_names, scales_held=scales_held, grads_held=in_memory)
    # a master the parameter holds is filled from it, not read; not a resident slice's: it
    # holds the master between steps, so the master it reads first (on its first resident
    # pass) must be the stored one, which a first step that let it lag would have left stale
    unread = () if piece.index in placement else valued_masters(piece, live)
    unbuffered = (
        sum(
            footprint(seg.slot.master_buffers(seg.numel)[0])  # as held_bytes counts it
            for seg in piece.segments
            if segment_region(seg.slot.master_key, seg) in unread
        )
        if masters_lag
        else 0
    )
    return Job(
        piece.index,
        tuple(region for region in reads if region not in unread),
        piece.held_bytes + (0 if shared else piece.scratch_bytes) - (held if scales_held else 0)
        - unbuffered,
        tier=tier,
        scratch=piece.scratch_bytes if shared else 0,
        unread=() if masters_lag else unread,
        transient=kept_grads(piece) if tier is not None else (),
    )  # fmt: skip


def kept_grads(piece: Slice) -> tuple[Region, ...]:
    """The regions of the gradients ``piece`` steps from, kept in the swap space (streamed
    parameters): a resident slice holds them, which each step's gradients refill, so a commit
    does not write them (``Job.transient``)."""
    return tuple(
        segment_region(seg.slot.grad_key, seg)
        for seg in piece.segments
        if seg.slot.steps_from_kept_grad
    )


def unbuffered_masters(piece: Slice, tensors: Container[Region]) -> tuple[Region, ...]:
    """The master regions of ``piece`` that its job neither read nor buffered
    (``masters_lag``): those its parameters hold as the slice steps (:func:`valued_masters`),
    which :func:`step_slice` takes from them (pass them in its ``unread``)."""
    return tuple(region for region in valued_masters(piece) if region not in tensors)


def valued_masters(piece: Slice, live: Container[int] = ()) -> tuple[Region, ...]:
    """The master regions of ``piece`` whose values a streamed parameter holds now (or, for
    the slots in ``live``, will hold when the slice steps), exactly: an fp32 parameter kept
    in memory between uses (``device_budget``) or in use (as one whose final gradient makes
    its slice step in backward), whose master it was read from, with the edits since written
    to it (before any step reads it) and the step's updates made to it too. The step steps
    the parameter's values in place (on the CPU), or fills the master from them, instead of
    reading it (:func:`step_slice`'s ``unread``)."""
    return tuple(
        segment_region(seg.slot.master_key, seg)
        for seg in piece.segments
        if seg.slot.streamed
        and seg.slot.has_master
        and not seg.slot.remainder
        and master_dtype(seg.slot.param) == seg.slot.param.dtype
        and (seg.slot.index in live or seg.slot.param.untyped_storage().nbytes() > 0)
    )


def slice_reads(
    piece: Slice,
    state_names: dict[int, list[str]],
    *,
    scales_held: bool = False,
    grads_held: Container[int] = (),
    kept_grads: bool = True,
) -> tuple[Region, ...]:
    """The regions a slice reads: the state that exists (its 8-bit scales only when they
    are not held: ``scales_held``), each master (with a streamed parameter's stored values
    when its master is a remainder), and, with ``kept_grads``, each gradient kept in the swap
    space, but those of the slots in ``grads_held`` (in memory)."""
    reads: list[Region] = []
    for seg in piece.segments:
        slot = seg.slot
        for name in state_names.get(slot.index, []):
            regions = state_regions(seg, name)
            reads += regions[:1] if scales_held and slot.scales_bytes else regions
        if slot.has_master:
            reads.append(segment_region(slot.master_key, seg))
        if slot.streamed and slot.remainder:  # the parameter's half of the master
            reads.append(segment_region(slot.param_key, seg))
        if kept_grads and slot.steps_from_kept_grad and slot.index not in grads_held:
            reads.append(segment_region(slot.grad_key, seg))
    return tuple(reads)


#: The name of the pipeline job that holds the 8-bit scales (:func:`scales_job`).
SCALES_JOB = "scales"


def scales_job(slots: list[Slot], state_names: dict[int, list[str]]) -> Job | None:
    """The job a layout that holds the 8-bit scales (:attr:`~tierswap.optim.plan.Layout.
    held_scales`) keeps in host memory (:meth:`tierswap.Pipeline.hold`): the whole scales
    array of each existing state of each slot slices cut, in whole pages as
    :attr:`~tierswap.optim.plan.Slot.scales_bytes` counts them; ``None`` when there is none
    (no state yet)."""
    reads = [
        Region(slot.state_keys(name)[1], 0, num_blocks(slot.local.numel()))
        for slot in slots
        if slot.scales_bytes
        for name in state_names.get(slot.index, [])
    ]
    if not reads:
        return None
    nbytes = sum(footprint(4 * region.numel) for region in reads)
    return Job(SCALES_JOB, tuple(reads), nbytes, tier=HOST)


def scales_views(
    piece: Slice, state_names: dict[int, list[str]], held: dict[Region, torch.Tensor]
) -> dict[Region, torch.Tensor]:
    """The 8-bit scales regions of ``piece``'s state as views of the ``held`` whole arrays
    (:func:`scales_job`'s tensors, :meth:`tierswap.Pipeline.hold`): the step decodes from and
    encodes into them in place, so they are not written back with the slice."""
    if not held:
        return {}
    by_key = {region.key: tensor for region, tensor in held.items()}
    views: dict[Region, torch.Tensor] = {}
    for seg in piece.segments:
        if not seg.slot.scales_bytes:
            continue
        for name in state_names.get(seg.slot.index, []):
            region = state_regions(seg, name)[1]
            whole = by_key.get(region.key)
            if whole is not None:
                views[region] = whole[region.start : region.stop]
    return views


def segment_region(key: str, seg: Segment) -> Region:
    """The elements of array ``key`` that ``seg`` covers."""
    return Region(key, seg.start, seg.stop)


def state_region(seg: Segment, name: str) -> Region:
    """The stored region of state ``name`` that ``seg`` steps: its own elements of per-element
    state, or the whole tensor (of the state's own shape) for a parameter stepped whole."""
    slot, key = seg.slot, f"{seg.slot.prefix}/{name}"
    if slot.whole_state is not None and name in slot.whole_state:
        shape, _ = slot.whole_state[name]
        return Region(key, 0, math.prod(shape))
    return segment_region(key, seg)


def state_regions(seg: Segment, name: str) -> list[Region]:
    """The stored regions of state ``name`` that ``seg`` steps, one per stored array: the
    codes and absmax of 8-bit state (block-aligned), else :func:`state_region`."""
    slot = seg.slot
    fmt = slot.moment_format(name)
    if fmt is None:
        return [state_region(seg, name)]
    ranges = fmt.array_ranges(seg.start, seg.stop, slot.local.numel())
    return [
        Region(key, lo, hi) for key, (lo, hi) in zip(slot.state_keys(name), ranges, strict=True)
    ]
