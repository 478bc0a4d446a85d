"""Flat-array helpers that the codecs of :mod:`tierswap.optim.formats` share: checked flat
views, results into the caller's arrays, and the pieces that keep temporaries small."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from tierswap.errors import InvalidTensorError

__all__ = [
    "CANONICAL_NAN_BITS",
    "PIECE",
    "as_flat",
    "check_count",
    "out_or_new",
    "piece_len",
    "pieces",
    "work_arrays",
]

#: Elements per piece of work: the 8-bit encoder's temporaries are 1.5 MiB (three 4-byte
#: arrays); 128 Ki encode 9-26% and decode 7-20% faster than 64 Ki here (`bench/codec.py`).
PIECE = 1 << 17
#: The bits of the fp32 NaN that the codecs write (bf16's is its upper half).
CANONICAL_NAN_BITS = 0x7FC00000


def piece_len(block_size: int) -> int:
    return max(PIECE // block_size, 1) * block_size


def work_arrays(numel: int, device: torch.device, *dtypes: torch.dtype) -> list[torch.Tensor]:
    """Work arrays of ``numel`` elements, one per dtype."""
    return [torch.empty(numel, dtype=dtype, device=device) for dtype in dtypes]


def pieces(numel: int, block_size: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``numel`` elements, each a whole number of blocks."""
    step = piece_len(block_size)
    for lo in range(0, numel, step):
        yield lo, min(lo + step, numel)


def check_count(stored: Sequence[torch.Tensor], count: int) -> None:
    if len(stored) != count:
        raise InvalidTensorError(
            f"{len(stored)} stored arrays given where the format has {count}; pass them in the "
            "order MomentFormat.arrays lists"
        )


def as_flat(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t`` as a flat view, checked: its dtype is ``dtype`` and its memory contiguous."""
    if t.dtype != dtype:
        raise InvalidTensorError(f"{what} is {t.dtype}; pass a {dtype} tensor")
    if not t.is_contiguous():
        raise InvalidTensorError(f"{what} is not contiguous; pass .contiguous() or a flat buffer")
    return t.view(-1)


def out_or_new(
    out: torch.Tensor | None,
    numel: int,
    dtype: torch.dtype,
    what: str,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``out`` as a flat view when given (checked), else a new tensor of ``numel``."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    flat = as_flat(out, dtype, what)
    if flat.numel() != numel:
        raise InvalidTensorError(f"{what} has {flat.numel()} elements; it needs {numel}")
    return flat
