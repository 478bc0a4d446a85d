"""Stepping one slice: the work stage of the optimizer's pipeline.

The inner torch optimizer of each segment's param group is pointed at flat views of the slice's
segments: the fp32 master region read from the store, or the parameter's own memory when it
needs no master. Its state tensors are the regions read for the slice. torch's own kernel
(for-loop, foreach or fused) then runs exactly as it would on whole parameters: the math of a
cut parameter's optimizer is per element, and a parameter whose optimizer's math spans it
(Muon, Adafactor) is stepped whole, viewed in its own shape (both checked by
:mod:`~tierswap.optim.plan._probe`), so the result is bitwise the same. Everything the step needs
comes in as arguments; nothing here reads the optimizer's members.

Where the step runs is where the tensors are: the pipeline hands the work device tensors when
the optimizer steps on the device (copied in on a side stream, and waited for by the compute
stream, by the engine's transfer layer) and copies the returned ones back; nothing here copies
between host and device or waits for the device.

Compact state (:mod:`~tierswap.optim.formats`): a state tensor stored in bf16 or 8 bits is read
as its stored regions (codes and absmax for 8 bits: slices start and end at block boundaries),
decoded into fp32 scratch where the step runs, stepped by torch's kernel in fp32 and encoded
back into the regions written. When the layout holds the 8-bit scales in host memory
(:attr:`~tierswap.optim.plan.Layout.held_scales`), a slice reads only its codes and views
its scales in the held arrays (:mod:`~tierswap.optim.step._slice_job`, which also says what
each slice reads). A master kept as
a remainder is joined with the parameter into fp32 scratch, stepped, and split into the
parameter (rounded half up) and the new remainder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container
from typing import Any

import torch

from tierswap.io import footprint
from tierswap.optim.formats import MomentFormat, join, split
from tierswap.optim.plan import (
    Segment,
    Slice,
    Slot,
    StepPlan,
    apply_grad_edits,
    array_chunk_bytes,
    flat,
    local_tensor,
)
from tierswap.optim.step._slice_job import segment_region, state_region, state_regions
from tierswap.pipeline import Region

__all__ = ["STEP_BLOCK", "Scratch", "clone_small", "step_slice"]


class Scratch:
    """Work buffers of one slice's step, cut from one buffer reused across slices (the
    pipeline's, :meth:`tierswap.Pipeline.scratch`): memory already mapped, so the decoded
    moments, joined masters and gradient casts cost no page faults. Each piece starts on a
    page, as :meth:`Segment.scratch_bytes` counts them; when the buffer is used up (or there is
    none, or the step runs on another device) :meth:`take` makes a new tensor instead.
    Used by one thread, for one slice."""

    def __init__(self, buffer: torch.Tensor | None) -> None:
        self._buffer = buffer
        self._used = 0

    def take(
        self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements on ``device``."""
        nbytes = numel * dtype.itemsize
        buffer = self._buffer
        if buffer is None or device.type != "cpu" or self._used + nbytes > buffer.numel():
            return torch.empty(numel, dtype=dtype, device=device)
        piece = buffer[self._used : self._used + nbytes].view(dtype)
        self._used += footprint(nbytes)
        return piece


#: Elements per block when a cut parameter steps on the CPU with a for-loop kernel (torch's
#: default there). Those kernels make a temporary of the tensor's size per operation and pass
#: over memory once per operation; on blocks of 512 KiB (fp32) the operands and temporaries
#: stay in the core's cache and below glibc's mmap threshold (no page faults), so AdamW steps
#: about 2.2x faster than on a whole 64 MiB slice; smaller blocks lose it again to Python's
#: per-tensor overhead (``docs/benchmarks.md``). A multiple of 64, as slice boundaries are:
#: torch's vectorised loops treat the last few elements of a tensor apart (the fused kernels
#: with other rounding), so a block must end only where a slice may.
STEP_BLOCK = 1 << 17


def step_slice(
    plan: StepPlan,
    piece: Slice,
    tensors: dict[Region, torch.Tensor],
    scratch_buffer: torch.Tensor | None = None,
    unread: Container[Region] = (),
) -> dict[Region, torch.Tensor]:
    """Step the live segments of ``piece``; return the regions to write back.
    ``scratch_buffer`` (``piece.scratch_bytes`` or more) holds the step's work buffers. The
    master regions in ``unread`` were not read: their parameters hold them
    (:func:`~tierswap.optim.step._slice_job.valued_masters`)."""
    segments = [seg for seg in piece.segments if seg.slot.index in plan.live]
    if not segments:
        return {}
    scratch = Scratch(scratch_buffer)
    targets = [_target(plan, seg, tensors, scratch, unread) for seg in segments]
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for seg, target in zip(segments, targets, strict=True):
        state[target] = _state_of(plan, seg, tensors, scratch)
    for inner in {
        id(plan.inners[seg.slot.group]): plan.inners[seg.slot.group] for seg in segments
    }.values():
        mine = [i for i, seg in enumerate(segments) if plan.inners[seg.slot.group] is inner]
        pieces = {
            i: _blocks(
                segments[i], plan.groups[segments[i].slot.group], targets[i], state[targets[i]]
            )
            for i in mine
        }
        stepped = {piece: st for i in mine for piece, st in pieces[i].items()}
        _step_inner(
            inner, _groups_for(plan.groups, [(segments[i], list(pieces[i])) for i in mine]), stepped
        )
        for i in mine:
            state[targets[i]] = _joined(state[targets[i]], pieces[i], stepped)
    writes: dict[Region, torch.Tensor] = {}
    for seg, target in zip(segments, targets, strict=True):
        writes.update(
            _collect(plan, seg, target, new_state=state[target], tensors=tensors, unread=unread)
        )
    return writes


def _step_inner(
    inner: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: dict[torch.Tensor, dict[str, Any]],
) -> None:
    """One ``inner.step()`` over ``groups`` with ``state`` (updated in place by torch)."""
    saved_groups = inner.param_groups
    inner.state, inner.param_groups = defaultdict(dict, state), groups
    try:
        inner.step()
        state.update(inner.state)
    finally:
        inner.param_groups, inner.state = saved_groups, defaultdict(dict)


def _stored_dtypes(slot: Slot, fmt: MomentFormat, name: str) -> list[torch.dtype]:
    return [array.dtype for array in fmt.arrays(name, slot.local.numel())]


def _shaped(slot: Slot, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """``tensor`` (flat) in the shape the optimizer sees: the parameter's or the state's own
    for a parameter stepped whole; flat for a cut one."""
    if slot.whole_state is None:
        return tensor
    if name is None:
        return tensor.view(slot.local.shape)
    return tensor.view(slot.whole_state[name][0]) if name in slot.whole_state else tensor


def _target(
    plan: StepPlan,
    seg: Segment,
    tensors: dict[Region, torch.Tensor],
    scratch: Scratch,
    unread: Container[Region] = (),
) -> torch.Tensor:
    """The tensor the inner optimizer steps for ``seg``, with its gradient attached."""
    slot = seg.slot
    held = plan.held.get(slot.index)
    if held is not None:  # a streamed gradient still in memory: a step in backward
        grad = _shaped(slot, local_tensor(held).reshape(-1)[seg.start : seg.stop])
    elif slot.keeps_grad:  # read with the slice, edited in place as clipping edits a gradient
        grad = _shaped(slot, tensors[segment_region(slot.grad_key, seg)])
        apply_grad_edits(grad, plan.grad_edits.get(slot.index, ()))
    else:
        whole_grad = slot.param.grad if plan.grads is None else plan.grads[slot.index]
        assert whole_grad is not None  # plan.live holds only slots whose gradient is final
        grad = _shaped(slot, local_tensor(whole_grad).reshape(-1)[seg.start : seg.stop])
    if slot.has_master:
        region = segment_region(slot.master_key, seg)
        stored = tensors.get(region)  # not buffered: a master that lags (slice_job)
        if region in unread:  # the parameter holds it (not an edit)
            values = flat(slot.param.data)[seg.start : seg.stop]
            if stored is None or values.device.type == "cpu" == stored.device.type:
                # stepped in place, as a parameter without a master, not copied in and back
                # (its write, if any, copies it into the job's buffer: the parameter may let
                # its values go once the slice has stepped)
                stored = values
            else:
                stored.copy_(values)
        assert stored is not None, region  # read, or held by the parameter
        if slot.remainder:  # the fp32 master, rebuilt exactly from the parameter
            param = _param_values(slot, seg, tensors).to(stored.device)
            stored = join(param, stored, scratch.take(seg.numel, stored.device))
        target = _shaped(slot, stored)
        target.grad = _cast(grad, target, scratch)
    else:
        target = _shaped(slot, flat(slot.param)[seg.start : seg.stop])
        target.grad = grad
    return target


def _cast(grad: torch.Tensor, target: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``grad`` in ``target``'s dtype and device: itself when it is already, else a copy
    (into a scratch buffer on the CPU: one pass, no fresh memory)."""
    if grad.dtype == target.dtype and grad.device == target.device:
        return grad
    if target.device.type != "cpu":
        return grad.to(target.device, target.dtype)
    cast = scratch.take(grad.numel(), target.device, target.dtype)
    return cast.view(grad.shape).copy_(grad)


def _state_of(
    plan: StepPlan, seg: Segment, tensors: dict[Region, torch.Tensor], scratch: Scratch
) -> dict[str, Any]:
    slot = seg.slot
    if slot.index in plan.fresh:
        return {}  # torch creates the state, as for a parameter it has never stepped
    state = clone_small(plan.small_before.get(slot.index, {}))
    for name in plan.state_names.get(slot.index, []):
        fmt = slot.moment_format(name)
        if fmt is None:
            state[name] = _shaped(slot, tensors[state_region(seg, name)], name)
            continue
        stored = [tensors[region] for region in state_regions(seg, name)]
        decoded = fmt.decode(stored, scratch.take(seg.numel, stored[0].device))
        state[name] = _shaped(slot, decoded, name)
    return state


def _groups_for(
    groups: list[dict[str, Any]], stepped: list[tuple[Segment, list[torch.Tensor]]]
) -> list[dict[str, Any]]:
    """Shallow copies of the segments' param groups holding the tensors to step."""
    by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
    for seg, tensors in stepped:
        by_group[seg.slot.group] += tensors
    return [{**groups[g], "params": by_group[g]} for g in sorted(by_group)]


def _blocks(
    seg: Segment, group: dict[str, Any], target: torch.Tensor, state: dict[str, Any]
) -> dict[torch.Tensor, dict[str, Any]]:
    """``target`` with its gradient and ``state``, cut into blocks of :data:`STEP_BLOCK`
    elements where that is exact and pays: a cut parameter (per-element math, and blocks
    start where slices may) with existing state, stepped on the CPU by a for-loop kernel
    (foreach and fused ones make no per-operation temporaries; blocks only slow them).
    Else ``{target: state}``."""
    n = target.numel()
    per_element = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    if (
        seg.slot.whole_state is not None
        or group.get("fused")
        or group.get("foreach")
        or target.device.type != "cpu"
        or n <= STEP_BLOCK
        or not per_element  # first step: torch creates the state, one tensor per parameter
        or any(v.shape != target.shape for v in per_element.values())
    ):
        return {target: state}
    scalars = {k: v for k, v in state.items() if k not in per_element}
    grad = target.grad
    assert grad is not None
    pieces: dict[torch.Tensor, dict[str, Any]] = {}
    for lo in range(0, n, STEP_BLOCK):
        piece = target[lo : lo + STEP_BLOCK]
        piece.grad = grad[lo : lo + STEP_BLOCK]
        views = {k: v[lo : lo + STEP_BLOCK] for k, v in per_element.items()}
        pieces[piece] = {**clone_small(scalars), **views}
    return pieces


def _joined(
    state: dict[str, Any],
    pieces: dict[torch.Tensor, dict[str, Any]],
    stepped: dict[torch.Tensor, dict[str, Any]],
) -> dict[str, Any]:
    """A segment's state after its blocks (:func:`_blocks`) stepped: the whole per-element
    tensors, which torch updated in place through the blocks' views (joined anew where it
    replaced them), and the scalar state of the first block (every block's is the same)."""
    if len(pieces) == 1:
        return stepped[next(iter(pieces))]
    joined = dict(state)
    for name, value in stepped[next(iter(pieces))].items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            joined[name] = value
            continue
        values = [stepped[piece][name] for piece in pieces]
        if not _views_of(values, state.get(name)):
            joined[name] = torch.cat(values)
    return joined


def _views_of(blocks: list[torch.Tensor], whole: Any) -> bool:
    """Whether ``blocks`` are still the consecutive views of ``whole`` that were stepped."""
    if not torch.is_tensor(whole):
        return False
    offset = whole.data_ptr()
    for block in blocks:
        if block.data_ptr() != offset or block.dtype != whole.dtype:
            return False
        offset += block.numel() * block.element_size()
    return offset == whole.data_ptr() + whole.numel() * whole.element_size()


def _collect(
    plan: StepPlan,
    seg: Segment,
    target: torch.Tensor,
    *,
    new_state: dict[str, Any],
    tensors: dict[Region, torch.Tensor],
    unread: Container[Region] = (),
) -> dict[Region, torch.Tensor]:
    """Regions to write after ``seg`` stepped (where it stepped: the pipeline copies them back);
    updates the parameter from its master. A master the parameter holds (in ``unread``) is
    not written under :attr:`StepPlan.unwritten` unless a commit is due."""
    slot = seg.slot
    writes: dict[Region, torch.Tensor] = {}
    small: dict[str, Any] = {}
    names = plan.state_names.setdefault(slot.index, [])
    for name, value in new_state.items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            small[name] = value
            continue
        fmt = slot.moment_format(name)
        if name not in names:  # created by this first step
            _create(plan, slot, name, fmt, value)
            names.append(name)
        if fmt is None:
            region = state_region(seg, name)
            writes[region] = value.view(-1)
        else:
            writes.update(_encoded(seg, name, fmt, value, tensors=tensors))
    plan.small_after[slot.index] = small
    target.grad = None
    if slot.remainder:
        writes.update(_split_master(plan, seg, target, tensors))
    elif slot.has_master:
        # A streamed parameter is read from its master before each use, unless it kept its
        # values (device_budget): then they are updated as any parameter's.
        if not slot.streamed:
            flat(slot.param)[seg.start : seg.stop].copy_(target.view(-1))
        elif slot.param.untyped_storage().nbytes() > 0:  # not an edit: .data moves no version
            values = flat(slot.param.data)[seg.start : seg.stop]
            if values.data_ptr() != target.data_ptr():  # (not stepped in place: _target)
                values.copy_(target.view(-1))
        writes.update(_master_write(plan, seg, target, unread))
    elif plan.write_params:
        writes[segment_region(slot.param_key, seg)] = target.view(-1)
    return writes


def _master_write(
    plan: StepPlan, seg: Segment, target: torch.Tensor, unread: Container[Region]
) -> dict[Region, torch.Tensor]:
    """The write of ``seg``'s stepped master, or none when the parameter holds its values (in
    ``unread``), the plan lets masters lag (:attr:`StepPlan.unwritten`) and no commit is due:
    then the region waits there until a commit or the parameter lets its values go."""
    region = segment_region(seg.slot.master_key, seg)
    if plan.unwritten is None:
        return {region: target.view(-1)}
    if region in unread and not plan.write_params:
        plan.unwritten.setdefault(seg.slot.index, set()).add(region)
        return {}
    plan.unwritten.get(seg.slot.index, set()).discard(region)
    return {region: target.view(-1)}


def _create(
    plan: StepPlan, slot: Slot, name: str, fmt: MomentFormat | None, value: torch.Tensor
) -> None:
    """Create the stored arrays of state ``name``, made by the first step."""
    if fmt is None:
        shape = value.shape if slot.whole else slot.local.shape
        plan.create(f"{slot.prefix}/{name}", tuple(shape), value.dtype, None)
        return
    for key, array in zip(slot.state_keys(name), fmt.arrays(name, slot.local.numel()), strict=True):
        plan.create(key, (array.numel,), array.dtype, array_chunk_bytes(array, plan.chunk_bytes))


def _encoded(
    seg: Segment,
    name: str,
    fmt: MomentFormat,
    value: torch.Tensor,
    *,
    tensors: dict[Region, torch.Tensor],
) -> dict[Region, torch.Tensor]:
    """The regions to write for state ``name`` (fp32 ``value``) encoded in ``fmt``: into the
    buffers read, or new ones (first step), on the device where it ran."""
    regions = state_regions(seg, name)
    buffers = [
        read
        if (read := tensors.get(region)) is not None
        else torch.empty(region.numel, dtype=dtype, device=value.device)
        for region, dtype in zip(regions, _stored_dtypes(seg.slot, fmt, name), strict=True)
    ]
    fmt.encode(value.reshape(-1), buffers)
    return dict(zip(regions, buffers, strict=True))


def _split_master(
    plan: StepPlan,
    seg: Segment,
    target: torch.Tensor,
    tensors: dict[Region, torch.Tensor],
) -> dict[Region, torch.Tensor]:
    """Split the stepped fp32 master ``target`` into the bf16 parameter (rounded half up)
    and the remainder; the regions to write: the remainder, and the parameter when due."""
    slot = seg.slot
    region = segment_region(slot.master_key, seg)
    remainder = tensors[region]  # read where the step runs: the new remainder goes there
    param = _param_values(slot, seg, tensors)
    if param.device == target.device:
        split(target.reshape(-1), param, remainder)
    else:
        param.copy_(split(target.reshape(-1), None, remainder)[0])
    writes = {region: remainder}
    if slot.streamed:  # the stored parameter is the only copy: written every step
        writes[segment_region(slot.param_key, seg)] = param
        if slot.param.untyped_storage().nbytes() > 0:  # kept between uses: updated too
            flat(slot.param.data)[seg.start : seg.stop].copy_(param)  # not an edit (.data)
    elif plan.write_params:
        writes[segment_region(slot.param_key, seg)] = param.detach()
    return writes


def _param_values(slot: Slot, seg: Segment, tensors: dict[Region, torch.Tensor]) -> torch.Tensor:
    """``seg``'s part of a remainder slot's parameter: in memory, or, streamed, the stored
    values the slice read (:func:`slice_reads`)."""
    if slot.streamed:
        return tensors[segment_region(slot.param_key, seg)]
    return flat(slot.param)[seg.start : seg.stop]


def clone_small(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of scalar state whose tensors (``step``) torch may update in place."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
