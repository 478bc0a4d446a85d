"""The optimizer's layout: its parameters cut into slices, and where each slice stays.

A :class:`Layout` is computed in one place (:func:`plan_layout`) from the slots, the budgets and
the policy, and replaced whole when any of them changes (a param group added, a resume with
another chunking); nothing edits one in place.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from typing import cast

from tierswap.engine import EvictionPolicy, LookaheadPolicy, place
from tierswap.optim.plan._partition import (
    Slice,
    Slot,
    check_budget,
    chunk_target,
    plan_slices,
)
from tierswap.tiers import DEVICE, HOST, TierName

__all__ = [
    "DEVICE_STREAM_SLICES",
    "MAX_CHUNK_BYTES",
    "MAX_SLICE_BYTES",
    "MIN_CHUNK_BYTES",
    "STREAM_CEILING",
    "STREAM_FLOOR",
    "STREAM_SLICES",
    "Layout",
    "interleave",
    "plan_layout",
]

#: Upper bound of one slice's working set: large enough that the per-slice overhead (a few
#: Python calls, one request per chunk) stays negligible, small enough to pipeline.
MAX_SLICE_BYTES = 64 << 20
#: Slices in flight that the streaming part of the budget is sized for: one read ahead, one
#: stepping, one or two being written back.
STREAM_SLICES = 4
#: Streamed slices on the device at once when the step runs there, reserved beside the slices
#: resident in the device tier: one copying in while one steps and one copies back.
DEVICE_STREAM_SLICES = 3
#: The streaming part of the host budget: a tenth, at least this much (or the whole budget when
#: it is smaller; less when the budgets hold much of the state, more when they hold little:
#: ``_streaming_part``), so that slices stay large enough for the disk; the rest holds
#: resident slices.
STREAM_FLOOR = 32 << 20
#: The most that floor rises to where the budgets hold little of the state (``_streaming_part``).
STREAM_CEILING = 128 << 20
#: Smallest and largest chunk of the state arrays (slices split parameters at chunk multiples).
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 16 << 20


@dataclasses.dataclass(frozen=True)
class Layout:
    """The slots (one per parameter), the slices they are cut into (in the order ``step()``
    streams them), and where each resident slice stays between steps.

    ``placement`` maps slice indices to ``"device"`` or ``"host"``; a slice not in it streams
    from disk every step. ``chunk_bytes`` is the chunk size of the state arrays (slices cut
    parameters at its multiples), ``host_budget`` the bytes of the host tier.

    ``held_scales`` is the host bytes (part of ``host_budget``) that hold the 8-bit scales
    (absmax) of every slot slices cut, whole, from their first read until the pipeline writes
    them back (a flush, a commit, a layout change): each slice then views its scales there
    instead of reading and rewriting them. 0: each slice reads its own, as its other state.
    A page of scales covers 262,144 elements (1,024 blocks), so when the budget makes slices
    smaller than that, several slices share each page: read per slice, a page would be read
    (and rewritten) once by each of them. Held, the scales cost 1/64 of the codes in memory
    and save at least their own bytes of disk traffic per step, which no resident slice's
    bytes do better: the layout holds them whenever the state streams and they fit
    (:func:`_scales_to_hold`).
    """

    slots: list[Slot]
    slices: list[Slice]
    placement: dict[int, TierName]
    chunk_bytes: int
    host_budget: int
    held_scales: int = 0

    #: Slot index -> the slices that hold part of it.
    slices_of: dict[int, list[Slice]] = dataclasses.field(init=False)
    #: ``id(param)`` -> its slot.
    slot_of: dict[int, Slot] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        slices_of: dict[int, list[Slice]] = defaultdict(list)
        for piece in self.slices:
            for slot in {seg.slot.index for seg in piece.segments}:
                slices_of[slot].append(piece)
        object.__setattr__(self, "slices_of", slices_of)
        object.__setattr__(self, "slot_of", {id(s.param): s for s in self.slots})


def plan_layout(
    slots: list[Slot],
    *,
    host_budget: int | None,
    device_budget: int,
    policy: str | EvictionPolicy,
    chunk_bytes: int | None = None,
    forward_order: bool = False,
    device_compute: bool = False,
    in_backward: bool = False,
) -> Layout:
    """Cut ``slots`` into slices, choose where each stays between steps, check the budgets.

    ``host_budget=None`` sizes the host tier to the whole state. When the state fits it, the
    slices are large; else each is about a ``STREAM_SLICES``-th of the streaming part of the
    budgets in RAM, at least a floor: :func:`_streaming_part`), and the 8-bit scales are held
    in host memory when they are small beside the budget and the step runs on the CPU
    (:attr:`Layout.held_scales`, :func:`_scales_to_hold`). The policy then chooses, on the
    step's cyclic schedule (forward order with ``forward_order``), which slices stay resident:
    in the device tier first (``device_budget``), then in host memory (what the host budget
    has beyond the streaming part and the held scales); the rest streams from disk
    (:func:`tierswap.engine.place`); with ``in_backward`` (every slice steps in backward, in
    backward's order) the lookahead policy's choice is then spread over that order
    (:func:`_spread`). ``chunk_bytes`` keeps a chunking already stored
    (``None``: choose one). ``device_compute``: slices step on a GPU, so streamed ones pass
    through device memory too. Raises ``ConfigError`` when a slice does not fit a budget.

    How the streaming part is counted: :func:`_capacities`.
    """
    chunk = chunk_bytes or _chunk_for(chunk_target(slots, MAX_SLICE_BYTES))
    whole = plan_slices(slots[::-1], MAX_SLICE_BYTES, chunk)
    sizes = _Sizes(device_compute)
    state = sum(map(sizes.held, whole))
    total = state + max(map(sizes.work, whole), default=0)
    budget = host_budget if host_budget is not None else max(total, 1)
    stream, slices = 0, whole
    if total > budget:
        for scales in _scales_to_hold(slots, budget, device_compute):
            sizes = _Sizes(device_compute, scales > 0)
            room = budget - scales
            stream = _streaming_part(room, device_budget, state - scales, device_compute)
            share = 1 if device_compute else _work_share(slots)
            target = min(max(int(stream * share), 1), MAX_SLICE_BYTES)
            chunk = chunk_bytes or _chunk_for(chunk_target(slots, target))
            slices = plan_slices(slots[::-1], target, chunk)
            if max(map(sizes.working_set, slices), default=0) <= room:
                break
    check_budget(slices, budget, "host_budget")
    if device_compute:
        check_budget(slices, device_budget, "device_budget")
    capacities = _capacities(
        max(map(sizes.held, slices), default=0), max(map(sizes.work, slices), default=0),
        total=sum(map(sizes.held, slices)),
        budget=budget - sizes.scales(slots), stream=stream, device_budget=device_budget,
        device_compute=device_compute,
    )  # fmt: skip
    order = slices[::-1] if forward_order else slices
    schedule = [str(piece.index) for piece in order]  # the order the slices step in
    placed = place(policy, schedule, {str(p.index): sizes.held(p) for p in slices}, capacities)
    placement = {int(key): cast(TierName, tier) for key, tier in placed.items()}
    lookahead = policy == "lookahead" or isinstance(policy, LookaheadPolicy)  # (not a user's)
    if in_backward and lookahead:
        placement = _spread(order, placement, sizes.held, capacities)
    return Layout(list(slots), slices, placement, chunk, budget, sizes.scales(slots))


def _spread(
    order: list[Slice],
    placement: dict[int, TierName],
    held: Callable[[Slice], int],
    capacities: dict[str, int],
) -> dict[int, TierName]:
    """``placement`` with its resident bytes spread evenly over the step's ``order`` instead
    of where the lookahead policy put them (Belady on a cycle keeps a prefix: the slices that
    step first). Each slice steps once a cycle, so any slices of the same bytes save the same
    disk traffic; spread out, the disk keeps working while a resident slice steps, where the
    order is not the step's to choose (slices stepping in backward, as each gradient becomes
    final). Not where resident slices wait for ``step()`` while the others step in backward
    (``overlap="auto"``): ``step()`` then reads nothing for them to hide, so where they fall
    in the order buys nothing. Each tier holds about what the policy gave it (tiers in
    ``capacities``' order, device first), never more than its capacity."""
    quota = {
        tier: sum(held(p) for p in order if placement.get(p.index) == tier) for tier in capacities
    }
    chosen, pool = sum(quota.values()), sum(map(held, order))
    room = dict(capacities)
    spread: dict[int, TierName] = {}
    credit = 0.0
    for piece in order:  # a slice becomes resident once its share of credit covers it
        size = held(piece)
        credit += size * chosen / pool if pool else 0.0
        tier = next((t for t in quota if quota[t] > 0 and size <= room[t]), None)
        if size > credit or tier is None:
            continue
        spread[piece.index] = cast(TierName, tier)
        credit -= size
        quota[tier] -= size
        room[tier] -= size
    return spread


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """How a layout counts a slice's bytes: what it holds from its reads to the end of its
    write-back (on a GPU, its whole working set), its work buffers (one buffer for all
    slices on the CPU: not counted per slice), and, with ``scales_held``, without its 8-bit
    scales, which the layout holds for all slices at once (:attr:`Layout.held_scales`)."""

    device_compute: bool
    scales_held: bool = False

    def held(self, piece: Slice) -> int:
        held = piece.working_set if self.device_compute else piece.held_bytes
        return held - self._own_scales(piece)

    def work(self, piece: Slice) -> int:
        return 0 if self.device_compute else piece.scratch_bytes

    def working_set(self, piece: Slice) -> int:
        return piece.working_set - self._own_scales(piece)

    def scales(self, slots: list[Slot]) -> int:
        """The bytes of the scales held for ``slots``."""
        return sum(slot.scales_bytes for slot in slots) if self.scales_held else 0

    def _own_scales(self, piece: Slice) -> int:
        return piece.scales_bytes if self.scales_held else 0


def _scales_to_hold(slots: list[Slot], budget: int, device_compute: bool) -> list[int]:
    """The bytes of held 8-bit scales to try, in order, for a layout that streams: all of the
    cut slots' scales when the step runs on the CPU and they take at most an eighth of the
    budget, then none (when the slices do not fit beside them); else none. On a GPU the
    slices' scales travel to the device with them."""
    scales = sum(slot.scales_bytes for slot in slots)
    if device_compute or scales == 0 or scales > budget // 8:
        return [0]
    return [scales, 0]


def _streaming_part(budget: int, device_budget: int, state: int, device_compute: bool) -> int:
    """Host bytes for the slices in flight: a tenth of the budgets in host memory (``budget``,
    and ``device_budget`` unless slices step on a GPU, whose memory it then is), within
    ``budget``, at least a floor (or the whole budget when it is smaller) so that slices
    stay large enough for the disk. A tenth of the host budget alone, beside a device tier in
    RAM that holds much more, left too few slices in flight to keep the disk busy.

    The floor buys large slices with residency; the disk traffic it allows is kept within
    1.05 x (state - 0.9 x budgets), ``state`` being the slices' held bytes. Where the budgets
    hold much of the state (more than a fifth) ``STREAM_FLOOR`` would leave a large share of
    them to streaming: it then shrinks with the share that streams, ``(state - budgets) /
    (4 x budgets)``, so that resident slices fill about 90% of the budgets. Where they hold
    less, residency saves little and each slice costs the step a fixed overhead (its Python,
    its chunk requests): the floor rises to what that traffic bound allows, ``state / 20 +
    0.055 x budgets``, less a fifth (the policy keeps whole slices, so the resident bytes may
    fall short of their room by up to a slice, a quarter of the streaming part), up to
    ``STREAM_CEILING`` (a 128 MiB host budget against 1.5 GiB of state: 68 MiB, 115 slices
    of up to 16 MiB instead of 212 of up to 8)."""
    budgets = budget + device_budget
    floor = STREAM_FLOOR
    if 0 < state - budgets < 4 * budgets:
        floor = STREAM_FLOOR * (state - budgets) // (4 * budgets)
    elif state - budgets >= 4 * budgets:
        allowed = (state // 20 + budgets * 55 // 1000) * 4 // 5
        floor = max(STREAM_FLOOR, min(allowed, STREAM_CEILING))
    in_ram = budget + (0 if device_compute else device_budget)
    return max(min(budget, in_ram // 10), min(budget, floor))


def _capacities(
    largest: int, work_buffer: int, *, total: int, budget: int, stream: int, device_budget: int,
    device_compute: bool,
) -> dict[str, int]:  # fmt: skip
    """Bytes each tier has for resident slices: the device budget (less the streamed slices
    passing through it when the step runs there, unless it holds all ``total`` bytes of the
    slices: then none streams), and the host budget less its streaming part (``stream``, or the
    slices in flight and the work buffer when they need more).

    On the CPU a slice holds its :attr:`~Slice.held_bytes` from its reads to the end of its
    write-back, resident or streamed, and the step's work buffers (the fp32 decodings of
    compact state, ...) are one buffer for all slices, of the largest slice's
    :attr:`~Slice.scratch_bytes` (:meth:`tierswap.Pipeline.scratch`), so the streaming part
    holds ``STREAM_SLICES`` slices plus that one buffer. On a GPU every slice counts its whole
    working set.
    """
    capacities: dict[str, int] = {DEVICE: device_budget}
    if device_compute and total > device_budget:  # streamed slices pass through the device
        capacities[DEVICE] = max(device_budget - DEVICE_STREAM_SLICES * largest, 0)
    in_flight = STREAM_SLICES * largest if stream else 0
    capacities[HOST] = budget - max(stream, in_flight + work_buffer)
    return capacities


def _work_share(slots: list[Slot]) -> float:
    """The share of the streaming part one slice's working set may take: a
    ``STREAM_SLICES``-th when slices need no work buffer; more when they do, since the
    streaming part then holds ``STREAM_SLICES`` slices without their work buffers and one
    work buffer: with ``r`` work bytes per held byte, ``STREAM_SLICES * w / (1 + r) +
    r * w / (1 + r)`` fills it for a working set ``w``. ``r`` is the cut parameters' mean
    over their elements; a slice of another kind then holds a little more or less than
    planned, which the room left for resident slices follows (:func:`plan_layout`)."""
    held = scratch = 0.0
    for slot in slots:
        if not slot.whole:
            numel = slot.local.numel()
            scratch += numel * slot.scratch_per_element
            held += numel * (slot.bytes_per_element - slot.scratch_per_element)
    r = scratch / held if held > 0 else 0.0
    return (1 + r) / (STREAM_SLICES + r)


def _chunk_for(target: int) -> int:
    """Chunk size of the state arrays for slices of about ``target`` bytes: a power of two,
    about a quarter of the slice per array, so slices split parameters finely."""
    chunk = MIN_CHUNK_BYTES
    while chunk * 2 <= target // 4 and chunk < MAX_CHUNK_BYTES:
        chunk *= 2
    return chunk


def interleave(pieces: list[Slice], placement: dict[int, TierName]) -> list[Slice]:
    """``pieces`` reordered so that the resident ones are spread evenly among the streamed
    ones, each in its own order: while a resident slice steps (no disk), the reads of the next
    streamed ones go on, so disk time hides behind the step's arithmetic instead of coming all
    at once after it. Slices step independently, so any order gives the same results."""
    streamed = [p for p in pieces if p.index not in placement]
    resident = [p for p in pieces if p.index in placement]
    if not streamed or not resident:
        return pieces
    order: list[Slice] = []
    given = 0
    for position, piece in enumerate(streamed, start=1):
        order.append(piece)
        due = len(resident) * position // len(streamed)  # residents owed after this one
        order.extend(resident[given:due])
        given = due
    return order
