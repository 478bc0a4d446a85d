"""A parameter's memory, freed between uses and refilled before each one.

Freeing resizes the parameter's storage to zero bytes: the tensor keeps its shape, dtype,
device and identity (``model.parameters()``, the optimizer's param groups and the views that
autograd saved for backward all still name it), and its data pointer becomes null, so a use
that nothing refilled fails loudly instead of reading stale memory. Refilling resizes the
storage back; every view of it sees the new memory. Writing through ``param.data`` does not
move the parameter's version counter, so the views autograd saved stay valid.
"""

from __future__ import annotations

import torch

__all__ = ["allocate", "free", "nbytes"]


def nbytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s values (what its storage holds when filled)."""
    return param.numel() * param.element_size()


def free(param: torch.Tensor) -> None:
    """Give ``param``'s memory back; its values are lost (the store keeps them).

    A storage that was handed to numpy (the store writes through numpy views) cannot be
    resized: the parameter first gets a storage of its own (before any use, while nothing
    else views it)."""
    if not param.untyped_storage().resizable():
        param.data = torch.empty_like(param, memory_format=torch.contiguous_format)
    param.untyped_storage().resize_(0)


def allocate(param: torch.Tensor) -> torch.Tensor:
    """Give ``param`` memory again (contents undefined); returns its flat view to fill."""
    storage = param.untyped_storage()
    if storage.nbytes() < nbytes(param):
        storage.resize_(nbytes(param))
    return param.data.view(-1)
