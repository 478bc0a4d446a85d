"""Tensors as bytes: the views the store reads into and writes from, without copies."""

from __future__ import annotations

import numpy as np
import torch

from tierswap.errors import InvalidTensorError
from tierswap.io import aligned_empty
from tierswap.store._dtypes import dtype_name
from tierswap.store._layout import ArrayMeta

__all__ = ["as_cpu_contiguous", "flat_bytes", "prepare_out", "spare_bytes"]


def flat_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def spare_bytes(tensor: torch.Tensor) -> int:
    """Writable bytes after the tensor's data within its storage (page padding)."""
    storage = tensor.untyped_storage()
    used = tensor.storage_offset() * tensor.element_size() + tensor.numel() * tensor.element_size()
    return int(storage.nbytes() - used)


def as_cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a plain, contiguous CPU tensor (itself when it is one already).

    Each op called here (``detach``, ``resolve_conj``, ...) lets the GIL go and must take it
    back from the I/O threads: about one per region a step writes, so only the ones a tensor
    needs are called (a plain tensor without grad, without the conj or neg bit, is as it
    is)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"put() takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise InvalidTensorError(f"layout {tensor.layout} cannot be stored; call .to_dense()")
    dtype_name(tensor.dtype)  # raises for dtypes that cannot be stored
    if type(tensor) is not torch.Tensor or tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def prepare_out(
    meta: ArrayMeta, out: torch.Tensor | None, region: int | None = None
) -> torch.Tensor:
    """``out`` checked for a read of ``meta``'s tensor (or a new page-aligned tensor): the whole
    tensor, or with ``region`` a run of that many elements (``out`` of any shape, returned 1-D)."""
    shape = meta.shape if region is None else (region,)
    if out is None:
        return aligned_empty(shape, meta.dtype)  # pinned when CUDA is present
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise InvalidTensorError(f"out= must be a CPU tensor for key {meta.key!r}")
    fits = tuple(out.shape) == meta.shape if region is None else out.numel() == region
    if out.dtype != meta.dtype or not fits:
        wanted = (
            f"{meta.dtype} {meta.shape}"
            if region is None
            else f"{meta.dtype} x {region} elements in that region"
        )
        raise InvalidTensorError(
            f"out= is {out.dtype} {tuple(out.shape)} but key {meta.key!r} holds {wanted}; "
            "pass a matching tensor"
        )
    if not out.is_contiguous():
        raise InvalidTensorError(f"out= for key {meta.key!r} must be contiguous")
    return out if region is None or out.dim() == 1 else out.view(-1)
