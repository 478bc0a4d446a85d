"""Tensors as bytes: the views the store reads into and writes from, without copies."""

from __future__ import annotations

import numpy as np
import torch

from tierswap.errors import InvalidTensorError
from tierswap.io._buffers import aligned_empty
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
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"put() takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise InvalidTensorError(f"layout {tensor.layout} cannot be stored; call .to_dense()")
    dtype_name(tensor.dtype)  # raises for dtypes that cannot be stored
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def prepare_out(meta: ArrayMeta, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return aligned_empty(meta.shape, meta.dtype)  # pinned when CUDA is present
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise InvalidTensorError(f"out= must be a CPU tensor for key {meta.key!r}")
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensorError(
            f"out= is {out.dtype} {tuple(out.shape)} but key {meta.key!r} holds "
            f"{meta.dtype} {meta.shape}; pass a matching tensor"
        )
    if not out.is_contiguous():
        raise InvalidTensorError(f"out= for key {meta.key!r} must be contiguous")
    return out
