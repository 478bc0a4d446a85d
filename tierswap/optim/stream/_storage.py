"""A parameter's memory, freed between uses and refilled before each one.

Freeing resizes the parameter's storage to zero bytes: the tensor keeps its shape, dtype,
device and identity (``model.parameters()``, the optimizer's param groups and the views that
autograd saved for backward all still name it), and its data pointer becomes null, so a use
that nothing refilled fails loudly instead of reading stale memory. Refilling resizes the
storage back; every view of it sees the new memory. Writing through ``param.data`` does not
move the parameter's version counter, so the views autograd saved stay valid.

A parameter built on the meta device cannot change device in place through ``.data``; it is
swapped for one on the real device whose storage is empty (``torch.utils.swap_tensors``: the
same Python object), and back to the meta device when the optimizer closes.

:class:`ParameterMemory` refills the storages of large parameters on the CPU with the
engine's page-aligned buffers: memory that ``device_budget`` leaves room for is reused between
uses, and fresh buffers ask for transparent huge pages. torch's allocator maps fresh 4 KiB
pages for each large allocation, and the first write to each faults. A 105 MB parameter (the
2-core bench machine) filled at 3.0 GB/s from the allocator, 7.6-13.6 GB/s into a fresh
buffer, 26 GB/s into a reused one.
"""

from __future__ import annotations

import torch

from tierswap.engine import BufferPool, transfers_for

__all__ = ["POOLED_FROM", "ParameterMemory", "allocate", "free", "nbytes", "to_meta", "to_placed"]

#: Parameters on the CPU of at least this many bytes get their memory from
#: :class:`ParameterMemory`'s pool (rounded up to whole pages: 0.4% at most); smaller ones
#: from the allocator, which reuses small blocks without new pages.
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

    A large parameter on the CPU (:data:`POOLED_FROM`) gets a page-aligned buffer of an
    engine :class:`~tierswap.engine.BufferPool`, swapped into its own storage (every view of
    the storage, autograd's saved ones among them, sees it) and swapped out to the pool when
    it is freed. Idle buffers stay within the room the caller gives (:meth:`allocate`,
    :meth:`trim`), and the next parameter of their size reuses their mapped pages; a new one
    asks for huge pages (:func:`~tierswap.io.aligned_empty`). Other parameters
    get memory from their device's allocator (on a GPU from the upload stream's pool:
    :meth:`~tierswap.engine.Transfers.allocating`), and give it back to it."""

    def __init__(self) -> None:
        self._pool = BufferPool(pin=False)
        self._pooled: set[int] = set()  # id() of the parameters that hold a pool buffer now

    @property
    def idle(self) -> int:
        """Bytes of pool buffers no parameter holds."""
        return self._pool.idle

    def allocate(
        self, params: list[torch.Tensor], *, room: int, pooled: bool = True
    ) -> list[torch.Tensor]:
        """Give each of ``params`` (holding no memory) memory, contents undefined; their flat
        views to fill. Idle buffers of the sizes they take are taken first, and the others
        beyond ``room`` bytes freed before any new memory is allocated. Without ``pooled``
        they get memory of their own (the optimizer closes: the model keeps it)."""
        large = [p for p in params if pooled and _poolable(p)]
        buffers = self._pool.claim([nbytes(p) for p in large])
        claimed = dict(zip(map(id, large), buffers, strict=True))
        self._pool.trim(max(0, room))
        flats = []
        try:
            for param in params:
                if id(param) in claimed:
                    buffer = claimed.pop(id(param))
                    if buffer is None:
                        buffer = self._pool.take(nbytes(param))
                    memory = buffer.untyped_storage()
                    param.untyped_storage()._swap_data_ptr_(memory)  # type: ignore[attr-defined]
                    self._pooled.add(id(param))
                    flats.append(param.data.view(-1))
                else:
                    with transfers_for(param.device).allocating():
                        flats.append(allocate(param))
        finally:  # a failure: the caller frees those given memory
            self._pool.give_all(list(claimed.values()))
        return flats

    def free(self, param: torch.Tensor) -> None:
        """Take ``param``'s memory back (:func:`free`): a pool buffer to the pool."""
        if id(param) not in self._pooled:
            free(param)
            return
        self._pooled.discard(id(param))
        holder = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
        param.untyped_storage()._swap_data_ptr_(holder)  # type: ignore[attr-defined]
        self._pool.give(torch.empty(0, dtype=torch.uint8).set_(holder))

    def keep_own(self, param: torch.Tensor) -> None:
        """Give ``param``, if it holds a pool buffer, memory of its own with the same values
        (the optimizer closes: the model keeps its parameters as it owned them)."""
        if id(param) not in self._pooled:
            return
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():  # not a user's use
            own = param.detach().clone(memory_format=torch.contiguous_format)
        param.untyped_storage()._swap_data_ptr_(own.untyped_storage())  # type: ignore[attr-defined]
        self._pooled.discard(id(param))
        self._pool.give(own)  # it holds the buffer now

    def trim(self, room: int) -> None:
        """Free idle buffers, largest first, until they fit in ``room`` bytes."""
        self._pool.trim(max(0, room))


def _poolable(param: torch.Tensor) -> bool:
    return (
        _SWAPS
        and param.device.type == "cpu"
        and nbytes(param) >= POOLED_FROM
        and param.untyped_storage().nbytes() == 0
    )


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
