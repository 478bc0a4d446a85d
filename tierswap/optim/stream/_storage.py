"""A parameter's memory, freed between uses and refilled before each one.

Freeing resizes the parameter's storage to zero bytes: the tensor keeps its shape, dtype,
device and identity (``model.parameters()``, the optimizer's param groups and the views that
autograd saved for backward all still name it), and its data pointer becomes null, so a use
that nothing refilled fails loudly instead of reading stale memory (:class:`ParameterMemory`
moves the memory out instead, to reuse it). Refilling resizes the storage back, or moves
memory in; every view of it sees the new memory. Writing through ``param.data`` does not
move the parameter's version counter, so the views autograd saved stay valid.

A parameter built on the meta device cannot change device in place through ``.data``; it is
swapped for one on the real device whose storage is empty (``torch.utils.swap_tensors``: the
same Python object), and back to the meta device when the optimizer closes.

:class:`ParameterMemory` lets the memory of a large parameter on the CPU, once freed, stay idle
for the next parameter of its size, within the room ``device_budget`` leaves and a share of
``host_budget`` set aside for it (:func:`idle_room`): refilling it writes into pages already
mapped. torch's allocator maps fresh 4 KiB pages for every large
allocation, and each faults at its first write. In a streamed GPT-2 (10 x 2560, the 2-core
bench machine, ``bench/param_refill.py``) refills ran at 3.2-3.7 GB/s with every use taking
new memory, 4.3-5.1 GB/s with a 1 GiB ``device_budget`` reusing part of it, 6.1-8.0 GB/s with
a quarter of a 2 GiB ``host_budget`` holding it and ``device_budget=0``; buffers new to
each use that asked for transparent huge pages ran at 2.2-2.6 GB/s there, so new memory comes
from the allocator.
"""

from __future__ import annotations

import torch

from tierswap.config import ALIGN
from tierswap.engine import BufferPool, transfers_for

__all__ = [
    "POOLED_FROM",
    "ParameterMemory",
    "allocate",
    "free",
    "idle_room",
    "nbytes",
    "to_meta",
    "to_placed",
]

#: Parameters on the CPU of at least this many bytes (in whole pages) leave their memory idle
#: for reuse (:class:`ParameterMemory`); the allocator reuses smaller blocks without new pages.
POOLED_FROM = 1 << 20

#: Whether this torch can move memory into an existing storage (private since torch 2.x;
#: FSDP and CUDA graph trees use it). Without it every refill allocates.
_SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def nbytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s values (what its storage holds when filled)."""
    return param.numel() * param.element_size()


def free(param: torch.Tensor) -> None:
    """Give ``param``'s memory back; its values are lost (the store keeps them).

    A storage that was handed to numpy (the store writes through numpy views) cannot be
    resized: the parameter first gets a storage of its own (before any use, while nothing
    else views it)."""
    if not param.untyped_storage().resizable():
        with torch._C.DisableTorchFunctionSubclass():  # not a user's .data: no guard's copy
            param.data = torch.empty_like(param, memory_format=torch.contiguous_format)
    param.untyped_storage().resize_(0)


def allocate(param: torch.Tensor) -> torch.Tensor:
    """Give ``param`` memory again (contents undefined); returns its flat view to fill."""
    storage = param.untyped_storage()
    if storage.nbytes() < nbytes(param):
        storage.resize_(nbytes(param))
    return param.data.view(-1)


class ParameterMemory:
    """Gives the storages of streamed parameters memory and takes it back (one per
    :class:`~tierswap.optim.stream.ParameterStream`; not thread-safe: the stream's callers
    take turns).

    Memory comes from the parameter's device allocator (on a GPU from the upload stream's
    pool: :meth:`~tierswap.engine.Transfers.allocating`). When a large parameter on the CPU
    (:data:`POOLED_FROM`, a whole number of pages) is freed, its memory moves out of its
    storage into an engine :class:`~tierswap.engine.BufferPool`, which keeps it idle within
    the room the caller gives (:meth:`allocate`, :meth:`trim`) and frees the rest; a
    parameter of that size refilled later takes it back into its own storage (every view of
    the storage, autograd's saved ones among them, sees it). That memory is an allocator
    block of exactly the parameter's bytes, as one allocated for it: the model keeps it when
    the optimizer closes. The pool only holds and trims it here (not page-aligned: nothing
    reads a file into it)."""

    def __init__(self) -> None:
        self._pool = BufferPool()

    @property
    def idle(self) -> int:
        """Bytes of memory no parameter holds, kept for reuse."""
        return self._pool.idle

    def allocate(self, params: list[torch.Tensor], *, room: int) -> list[torch.Tensor]:
        """Give each of ``params`` (holding no memory) memory, contents undefined; their flat
        views to fill. Idle memory of the sizes they take is taken first, and the rest beyond
        ``room`` bytes freed before anything new is allocated."""
        large = [p for p in params if _reusable(p) and p.untyped_storage().nbytes() == 0]
        buffers = self._pool.claim([nbytes(p) for p in large])
        claimed = {id(p): b for p, b in zip(large, buffers, strict=True) if b is not None}
        self._pool.trim(max(0, room))
        flats = []
        try:
            for param in params:
                buffer = claimed.pop(id(param), None)
                if buffer is not None:
                    _move(buffer.untyped_storage(), param.untyped_storage())
                    flats.append(param.data.view(-1))
                else:
                    with transfers_for(param.device).allocating():
                        flats.append(allocate(param))
        finally:  # a failure: the caller frees those given memory
            self._pool.give_all(list(claimed.values()))
        return flats

    def free(self, param: torch.Tensor) -> None:
        """Take ``param``'s memory back (:func:`free`); a large CPU parameter's goes to the
        pool, which keeps it until the next :meth:`allocate` or :meth:`trim`."""
        storage = param.untyped_storage()
        own = storage.resizable() and not storage.is_shared()  # no numpy view, no other process
        if not (_reusable(param) and storage.nbytes() == nbytes(param) and own):
            free(param)
            return
        holder = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
        _move(storage, holder)
        self._pool.give(torch.empty(0, dtype=torch.uint8).set_(holder))

    def trim(self, room: int) -> None:
        """Free idle memory, largest first, until it fits in ``room`` bytes."""
        self._pool.trim(max(0, room))


def _move(source: torch.UntypedStorage, target: torch.UntypedStorage) -> None:
    """Swap the memory of two storages (``target`` empty: ``source`` gives its to it)."""
    target._swap_data_ptr_(source)  # type: ignore[attr-defined]


def _reusable(param: torch.Tensor) -> bool:
    """Whether ``param``'s memory may serve another parameter of its size: on the CPU, at least
    :data:`POOLED_FROM` bytes, whole pages (the pool's sizes)."""
    return param.device.type == "cpu" and _pooled(nbytes(param))


def _pooled(size: int) -> bool:
    """Whether memory of ``size`` bytes is kept for reuse (:func:`_reusable` on the CPU)."""
    return _SWAPS and size >= POOLED_FROM and size % ALIGN == 0


def idle_room(sizes: list[int], *, host_budget: int, kept: int) -> int:
    """Bytes of ``host_budget`` set aside for the memory that streamed CPU parameters of
    ``sizes`` bytes leave idle between uses (:class:`ParameterMemory`), where ``kept`` bytes of
    ``device_budget`` do not keep them all: a quarter of the budget at most, none when that
    would not hold the smallest one that is reused.

    A refill into memory already mapped saves the page faults of new memory (about 0.18 s per
    GB refilled on the bench machine: 2.50 against 1.13 s for 7.8 GB, ``bench/param_refill.py``
    with ``device_budget=0``); what the budget would hold of optimizer state instead saves the
    disk two bytes per byte and step."""
    pooled = [size for size in sizes if _pooled(size)]
    if not pooled:
        return 0
    room = min(host_budget // 4, sum(pooled) - kept)
    return room if room >= min(pooled) else 0


def to_placed(param: torch.nn.Parameter, device: torch.device) -> None:
    """Turn a meta-device ``param`` into one on ``device`` that holds no memory, in place: the
    same Python object, its attributes kept (what :func:`free` leaves)."""
    _swap(param, torch.empty(param.shape, dtype=param.dtype, device=device))
    free(param)


def to_meta(param: torch.Tensor) -> None:
    """Turn ``param`` into a meta-device tensor (shape and dtype, no values), in place."""
    _swap(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))


def _swap(param: torch.Tensor, tensor: torch.Tensor) -> None:
    replacement = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
    replacement.__dict__.update(param.__dict__)  # swap_tensors swaps the attributes too
    torch.utils.swap_tensors(param, replacement)  # type: ignore[no-untyped-call]
