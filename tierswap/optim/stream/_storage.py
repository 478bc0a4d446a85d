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
"""

from __future__ import annotations

import torch

__all__ = ["allocate", "free", "nbytes", "to_meta", "to_placed"]


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
