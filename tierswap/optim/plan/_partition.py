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

from tierswap.config import ALIGN, format_size
from tierswap.errors import ConfigError
from tierswap.io import footprint
from tierswap.optim.formats import (
    BLOCK_SIZE,
    MIN_8BIT_NUMEL,
    MomentFormat,
    StatePrecision,
    StoredArray,
    is_moment,
    num_blocks,
)

__all__ = [
    "WHOLE_TEMPORARIES",
    "StateShapes",
    "Segment",
    "Slice",
    "Slot",
    "array_chunk_bytes",
    "check_budget",
    "flat",
    "chunk_target",
    "master_dtype",
    "plan_slices",
]

#: State tensors of a parameter stepped whole: name -> (shape, element size).
StateShapes = dict[str, tuple[tuple[int, ...], int]]

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


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view of a parameter's (local) storage that slices index."""
    return local_tensor(tensor).view(-1)


@dataclasses.dataclass
class Slot:
    """One parameter: its global index, name and key, group, and bookkeeping.

    ``has_master`` is true when the step runs on a separate copy of the parameter (a fp32 master
    of a low-precision parameter, or a host copy of a parameter that lives on another device).
    ``state_itemsizes`` lists the element size of each per-element state tensor, probed from the
    optimizer class (``[4, 4]`` for AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32).
    ``whole_state`` is set for a parameter that must step whole (its optimizer's math spans the
    parameter, as Muon's and Adafactor's do): its state tensors' shapes and element sizes.

    ``precision`` is the ``state_precision`` asked for: it applies to fp32 moments of the
    parameter's size (:meth:`stored_precision`, :meth:`moment_format`), of a parameter that
    slices may cut or of one stepped whole (Muon's momentum); other state (factored, not a
    moment, or in another dtype) is kept as torch makes it. ``remainder``
    is set for a bf16 parameter under ``master="remainder"``: its master is stored as the int16
    remainder under :attr:`master_key` and the parameter itself under :attr:`param_key`.
    ``streamed`` is set under ``offload_parameters``: the parameter holds no memory between
    uses, so its master (``has_master`` is set) is the one copy of its values, which the step
    updates and :mod:`~tierswap.optim.stream` reads into the parameter before each use.
    """

    index: int
    param: torch.Tensor
    group: int
    has_master: bool
    state_itemsizes: tuple[int, ...]
    name: str | None = None  # the parameter's name, when the optimizer was given names
    key: str = ""  # the key segment of its arrays; "" means positional, ``p<index>``
    whole_state: StateShapes | None = None
    precision: StatePrecision = "fp32"
    remainder: bool = False
    state_names: tuple[str, ...] = ()  # the names of the per-element state, as probed
    streamed: bool = False  # offload_parameters: the master is the parameter's only copy
    #: A streamed parameter's gradient goes from backward to its slices' step in memory, never
    #: through the swap space (``overlap="backward"``, one backward pass a step): no slice
    #: reads it there, and a resident slice holds no buffer for it.
    grads_in_memory: bool = False

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
        """The key of the master: the fp32 ``master``, or the int16 ``remainder``."""
        return f"{self.prefix}/{'remainder' if self.remainder else 'master'}"

    @property
    def persists_param(self) -> bool:
        """Whether the store keeps a copy of the parameter under :attr:`param_key` (written
        when a commit is due): when it has no master, or a remainder joined to it."""
        return not self.has_master or self.remainder

    @property
    def restore_key(self) -> str:
        """The array a resume copies into the parameter."""
        return self.param_key if self.persists_param else self.master_key

    @property
    def stored_precision(self) -> StatePrecision:
        """The format of the slot's state (fp32 where compact state does not apply: state not
        in fp32, or not all moments (ASGD's ``ax``, Rprop's ``prev``, Adafactor's factored
        ``row_var``: :func:`~tierswap.optim.formats.is_moment`), or, for a parameter stepped
        whole, not all of the parameter's size; 8-bit under ``MIN_8BIT_NUMEL``)."""
        numel = self.local.numel()
        if self.precision == "fp32" or master_dtype(self.param) != torch.float32:
            return "fp32"
        if self.precision == "8bit" and numel < MIN_8BIT_NUMEL:
            return "fp32"
        if self.whole_state is not None:
            shapes = self.whole_state.items()
            sizes = {name: (math.prod(shape), size) for name, (shape, size) in shapes}
        else:
            pairs = zip(self.state_names, self.state_itemsizes, strict=True)
            sizes = {name: (numel, size) for name, size in pairs}
        if not sizes or any(n != numel or size != 4 for n, size in sizes.values()):
            return "fp32"
        return self.precision if all(is_moment(name) for name in sizes) else "fp32"

    def moment_format(self, name: str) -> MomentFormat | None:
        """How state ``name`` is stored: a compact format, or ``None`` (as torch makes it)."""
        if self.stored_precision == "fp32":
            return None
        return MomentFormat.for_state(name, self.local.numel(), self.stored_precision)

    def _format(self, name: str) -> MomentFormat:
        fmt = self.moment_format(name)
        assert fmt is not None  # the caller checked stored_precision
        return fmt

    def chunk_overrides(self, name: str, chunk_bytes: int) -> dict[str, int]:
        """The chunk size of each array of state ``name`` that does not take the store's
        ``chunk_bytes`` (key -> bytes): see :func:`array_chunk_bytes`."""
        fmt = self.moment_format(name)
        if fmt is None:
            return {}
        arrays = fmt.arrays(name, self.local.numel())
        chunks = {f"{self.prefix}/{a.name}": array_chunk_bytes(a, chunk_bytes) for a in arrays}
        return {key: chunk for key, chunk in chunks.items() if chunk is not None}

    def state_keys(self, name: str) -> list[str]:
        """The keys of the arrays that store state ``name``."""
        fmt = self.moment_format(name)
        if fmt is None:
            return [f"{self.prefix}/{name}"]
        return [f"{self.prefix}/{a.name}" for a in fmt.arrays(name, self.local.numel())]

    @property
    def block(self) -> int:
        """Elements a slice cut must be a multiple of (an 8-bit block, else 1)."""
        return BLOCK_SIZE if self.stored_precision == "8bit" else 1

    def state_buffers(self, numel: int) -> list[int]:
        """Bytes of each buffer a segment of ``numel`` elements holds for its state: the
        stored regions, and for compact state the fp32 scratch the step decodes into."""
        precision = self.stored_precision
        if precision == "fp32":
            return [numel * size for size in self.state_itemsizes]
        if precision == "bf16":
            per_state = [2 * numel, 4 * numel]
        else:
            per_state = [numel, 4 * num_blocks(numel), 4 * numel]
        return per_state * self.state_count

    def scratch_buffers(self, numel: int) -> list[int]:
        """Bytes of the work buffers among :meth:`state_buffers` and :meth:`master_buffers`
        (fp32 scratch a compact state decodes into, a master's joined fp32 copy, the
        gradient's cast, the split parameter): what the step writes that is not read or
        written back, so it can come from memory reused across slices."""
        scratch = [] if self.stored_precision == "fp32" else [4 * numel] * self.state_count
        read = 2 if self.streamed and self.remainder else 1  # buffers read, not scratch
        return scratch + self.master_buffers(numel)[read:]

    @property
    def state_count(self) -> int:
        """How many state tensors the slot keeps (per element, or of a whole parameter)."""
        return len(self.whole_state if self.whole_state is not None else self.state_itemsizes)

    def master_buffers(self, numel: int) -> list[int]:
        """Bytes of each buffer a segment of ``numel`` elements holds for its master: the fp32
        master and the gradient's cast; for a remainder, the remainder, the master joined into
        fp32 scratch, the gradient's cast and the parameter :func:`split` writes (a streamed
        parameter's: read with the remainder, second)."""
        if not self.has_master:
            return []
        if self.remainder and self.streamed:
            return [2 * numel, 2 * numel, 4 * numel, 4 * numel]
        if self.remainder:
            return [2 * numel, 4 * numel, 4 * numel, 2 * numel]
        return [master_dtype(self.param).itemsize * numel] * 2

    @property
    def param_key(self) -> str:
        return f"{self.prefix}/param"

    @property
    def grad_key(self) -> str:
        """The key of a streamed parameter's gradient, kept in the swap space from the moment
        backward finalizes it until the step reads it."""
        return f"{self.prefix}/grad"

    @property
    def keeps_grad(self) -> bool:
        """Whether the gradient may live in the swap space (a streamed trainable parameter):
        it has an array there."""
        return self.streamed and self.param.requires_grad

    @property
    def steps_from_kept_grad(self) -> bool:
        """Whether a step reads the gradient from the swap space: one that :attr:`keeps_grad`,
        unless every step takes it from memory (:attr:`grads_in_memory`)."""
        return self.keeps_grad and not self.grads_in_memory

    def grad_buffers(self, numel: int) -> list[int]:
        """Bytes of the buffer a segment of ``numel`` elements reads its kept gradient into
        (a resident slice holds it between steps)."""
        return [self.param.dtype.itemsize * numel] if self.steps_from_kept_grad else []

    @property
    def state_bytes(self) -> int:
        """Cache footprint of the state: each tensor occupies whole 4 KiB pages."""
        numel = self.local.numel()
        if self.whole_state is not None and self.stored_precision != "fp32":  # as stored
            arrays = [
                a for name in self.whole_state for a in self._format(name).arrays(name, numel)
            ]
            return sum(footprint(a.numel * a.dtype.itemsize) for a in arrays)
        if self.whole_state is not None:
            return sum(footprint(math.prod(s) * size) for s, size in self.whole_state.values())
        return sum(footprint(numel * size) for size in self.state_itemsizes)

    @property
    def scales_bytes(self) -> int:
        """Footprint of the whole 8-bit scales (absmax) arrays of a slot that slices cut (the
        bytes a layout holding them in host memory keeps for the slot: :class:`Layout`); 0
        for other slots."""
        if self.whole or self.stored_precision != "8bit":
            return 0
        return self.state_count * footprint(4 * num_blocks(self.local.numel()))

    @property
    def master_bytes(self) -> int:
        """Footprint of the stored master (fp32 master or remainder)."""
        if not self.has_master:
            return 0
        return footprint(self.master_buffers(self.local.numel())[0])

    @property
    def working_set(self) -> int:
        """Bytes held for this slot while it steps whole: state, master and kept gradient."""
        grad = sum(footprint(n) for n in self.grad_buffers(self.local.numel()))
        return self.state_bytes + self.master_bytes + grad

    @property
    def bytes_per_element(self) -> int:
        """Host bytes per element while stepping (rounded up): state (stored and decoded), and
        master plus fp32 gradient."""
        per_block = (
            sum(self.state_buffers(BLOCK_SIZE))
            + sum(self.master_buffers(BLOCK_SIZE))
            + sum(self.grad_buffers(BLOCK_SIZE))
        )
        return -(-per_block // BLOCK_SIZE)

    @property
    def scratch_per_element(self) -> float:
        """Bytes of work buffers per element while stepping (part of
        :attr:`bytes_per_element`)."""
        return sum(self.scratch_buffers(BLOCK_SIZE)) / BLOCK_SIZE

    @property
    def min_itemsize(self) -> int:
        """Smallest element size among the slot's stored arrays (state, master, param)."""
        state = {"fp32": self.state_itemsizes, "bf16": (2,), "8bit": (1,)}[self.stored_precision]
        sizes = [*state, 2 if self.remainder else master_dtype(self.param).itemsize]
        if self.persists_param or self.keeps_grad:
            sizes.append(self.param.dtype.itemsize)
        return min(sizes)


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
        master = sum(footprint(n) for n in self.slot.master_buffers(numel))
        master += sum(footprint(n) for n in self.slot.grad_buffers(numel))
        if self.slot.whole:
            decoded = 0 if self.slot.stored_precision == "fp32" else self.slot.state_count
            temporaries = WHOLE_TEMPORARIES + decoded  # compact state decodes into fp32 copies
            return self.slot.state_bytes + master + footprint(numel * 4) * temporaries
        return sum(footprint(n) for n in self.slot.state_buffers(numel)) + master

    @property
    def scratch_bytes(self) -> int:
        """Host bytes of this segment's work buffers (:meth:`Slot.scratch_buffers`), part of
        its working set: in whole pages, as the working set counts them."""
        if self.numel == 0 or self.slot.whole:
            return 0
        return sum(footprint(n) for n in self.slot.scratch_buffers(self.numel))

    @property
    def held_bytes(self) -> int:
        """The working set less the work buffers: what the segment holds from its reads to
        the end of its write-back (the work buffers serve one step at a time, on the CPU)."""
        return self.working_set - self.scratch_bytes

    @property
    def scales_bytes(self) -> int:
        """Bytes of this segment's 8-bit scales (absmax) regions among its held bytes, in
        whole pages as the working set counts them: what it does not hold itself when the
        layout holds the slot's scales (:attr:`Slot.scales_bytes`)."""
        if self.numel == 0 or self.slot.scales_bytes == 0:
            return 0
        return self.slot.state_count * footprint(4 * num_blocks(self.numel))


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
    def scratch_bytes(self) -> int:
        """Bytes of the work buffers of all segments (the step's reused scratch)."""
        return sum(seg.scratch_bytes for seg in self.segments)

    @property
    def held_bytes(self) -> int:
        """Bytes held from the slice's reads to the end of its write-back, work buffers
        aside (:meth:`Segment.held_bytes`)."""
        return sum(seg.held_bytes for seg in self.segments)

    @property
    def scales_bytes(self) -> int:
        """Bytes of the 8-bit scales regions among :attr:`held_bytes`
        (:meth:`Segment.scales_bytes`)."""
        return sum(seg.scales_bytes for seg in self.segments)

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
        # whole chunks of every array, and whole 8-bit blocks (chunks hold whole blocks anyway)
        unit = math.lcm(max(chunk_bytes // slot.min_itemsize, 1), slot.block)
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


def array_chunk_bytes(array: StoredArray, chunk_bytes: int) -> int | None:
    """The chunk size of a stored array whose elements stand for several of its tensor's
    (8-bit scales: one per block), so that a chunk of it covers the elements of one chunk of
    ``chunk_bytes`` one-byte codes, which slices cut at: a slice then reads and writes its
    scales as whole chunks, not as part of a chunk shared with its neighbours (read whole and
    rewritten). At least a page: with codes chunks under ``ALIGN * covers / itemsize`` bytes
    (256 KiB for fp32 scales of 256-element blocks) a scales chunk spans several slices.
    ``None`` for the other arrays: they take the store's chunk size."""
    if array.covers == 1:
        return None
    return max(chunk_bytes * array.dtype.itemsize // array.covers, ALIGN)


def chunk_target(slots: Sequence[Slot], target_bytes: int) -> int:
    """The slice size the chunk size is chosen for: ``target_bytes``, scaled down where an
    array has elements under 4 bytes (8-bit codes, bf16 moments, remainders), so that a chunk
    of those holds no more elements than an fp32 chunk would and slices stay as fine."""
    smallest = min((min(slot.min_itemsize, 4) for slot in slots), default=4)
    return target_bytes * smallest // 4


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


def check_first_steps(slices: Sequence[Slice], fresh: set[int], budget: int, name: str) -> None:
    """Raise :class:`ConfigError` when the first step of a slice holding a ``fresh`` slot (a
    param group added after steps) cannot fit ``budget`` beside the work buffer that the
    slices with state share: that pass counts its own work tensors (the step's job of it)."""

    def touches(piece: Slice) -> bool:
        return any(seg.slot.index in fresh for seg in piece.segments)

    work = max((p.scratch_bytes for p in slices if not touches(p)), default=0)
    need = max((p.working_set for p in slices if touches(p)), default=0) + work
    if need > budget:
        raise ConfigError(
            f"{name}={format_size(budget)} ({budget} bytes) cannot step the added group's "
            f"parameters a first time beside the work buffer of the others; the minimum is "
            f"{format_size(need)} ({need} bytes): raise {name} to at least {need}"
        )
