"""Exact master remainders (``master="remainder"``) of bf16 parameters.

A bf16 parameter's fp32 master is kept as the parameter plus a 16-bit signed remainder, the
difference between the master's bits and the parameter's bits shifted up (TransformerEngine's
``store_param_remainders``). Writing the master's bits as ``high:low`` (16 bits each), the
parameter is ``high`` when ``low < 0x8000`` and ``high + 1`` otherwise (one bf16 step away from
zero), and the remainder is ``low`` read as an ``int16``: ``[0, 32767]`` or ``[-32768, -1]``.
Round-half-even would need a remainder of ``+0x8000`` at the ties it rounds down, one more
than an int16 holds, so every tie rounds away from zero (:func:`round_half_up_bf16`): the
parameter is torch's ``.to(torch.bfloat16)`` except where ``low == 0x8000`` and ``high`` is
even, where it is one bf16 step further from zero.
:func:`join` of :func:`split` gives the master back bit for bit for every fp32 that is not
NaN: finite values (subnormals, ``-0.0`` included), ``±inf`` (remainder 0), and finite values
above the largest bf16 (a parameter of ``±inf``, as torch's cast gives, and the master intact).
A NaN master gives a NaN parameter and joins to a NaN, its payload not always kept. On the
CPU both run in C kernels (:mod:`~tierswap.optim.formats._native`), bit for bit the torch ops
below, which serve CUDA tensors and machines without a C compiler.
"""

from __future__ import annotations

import sys

import torch

from tierswap.errors import InvalidTensorError
from tierswap.optim.formats._arrays import (
    CANONICAL_NAN_BITS,
    PIECE,
    as_flat,
    out_or_new,
    pieces,
    work_arrays,
)
from tierswap.optim.formats._native import for_tensors

__all__ = ["join", "round_half_up_bf16", "split"]

_BF16_NAN_BITS = CANONICAL_NAN_BITS >> 16
# Index of the low and high 16-bit half of an fp32 seen as two int16s.
_LOW, _HIGH = (0, 1) if sys.byteorder == "little" else (1, 0)


def round_half_up_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with ties away from zero, into ``out`` (returned): the
    parameter :func:`split` makes (torch's cast rounds ties to even)."""
    src = as_flat(x, torch.float32, "x")
    dst = out_or_new(out, src.numel(), torch.bfloat16, "out", src.device)
    _split_bits(src, dst.view(torch.int16), None)
    return dst


def split(
    master: torch.Tensor,
    param: torch.Tensor | None = None,
    remainder: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` as a bf16 ``param`` (:func:`round_half_up_bf16`) and an int16
    ``remainder``, written into the tensors given (both returned); :func:`join` undoes it."""
    src = as_flat(master, torch.float32, "master")
    param_out = out_or_new(param, src.numel(), torch.bfloat16, "param", src.device)
    remainder_out = out_or_new(remainder, src.numel(), torch.int16, "remainder", src.device)
    _split_bits(src, param_out.view(torch.int16), remainder_out)
    return param_out, remainder_out


def _split_bits(
    master: torch.Tensor, param_bits: torch.Tensor, remainder: torch.Tensor | None
) -> None:
    """``param_bits`` = the master's upper half, plus 1 where its lower half is ``>= 0x8000``
    (negative as int16), and bf16's NaN where the master is NaN (its upper half alone can be
    inf, plus 1 can wrap it to zero); ``remainder`` = the lower half."""
    given = [t for t in (master, param_bits, remainder) if t is not None]
    if (native := for_tensors(*given)) is not None:
        native.split(master, param_bits, remainder)
        return
    low, high = _halves(master)
    carry, nan = work_arrays(min(master.numel(), PIECE), master.device, torch.int16, torch.bool)
    for lo, hi in pieces(master.numel(), 1):
        up, is_nan, out = carry[: hi - lo], nan[: hi - lo], param_bits[lo:hi]
        torch.bitwise_right_shift(low[lo:hi], 15, out=up)  # -1 where low >= 0x8000, else 0
        torch.sub(high[lo:hi], up, out=out)
        torch.ne(master[lo:hi], master[lo:hi], out=is_nan)
        out.masked_fill_(is_nan, _BF16_NAN_BITS)
        if remainder is not None:
            remainder[lo:hi].copy_(low[lo:hi])


def join(
    param: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 master that :func:`split` made ``param`` and ``remainder`` of, into ``out``
    (returned): bits ``(param << 16) + remainder``, exactly."""
    param_bits = as_flat(param, torch.bfloat16, "param").view(torch.int16)
    rem = as_flat(remainder, torch.int16, "remainder")
    if rem.numel() != param_bits.numel():
        raise InvalidTensorError(
            f"remainder has {rem.numel()} elements for a param of {param_bits.numel()}; "
            "pass the remainder split() made for this parameter"
        )
    dst = out_or_new(out, rem.numel(), torch.float32, "out", rem.device)
    dst_bits = dst.view(torch.int32)
    if (native := for_tensors(param_bits, rem, dst)) is not None:
        native.join(param_bits, rem, dst)
        return dst
    (shifted,) = work_arrays(min(rem.numel(), PIECE), rem.device, torch.int32)
    for lo, hi in pieces(rem.numel(), 1):
        work = shifted[: hi - lo]
        work.copy_(param_bits[lo:hi]).bitwise_left_shift_(16)
        torch.add(work, rem[lo:hi], out=dst_bits[lo:hi])  # wraps as the bits of a sum should
    return dst


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 16 bits of each element of fp32 ``t``, as strided int16 views."""
    pairs = t.view(torch.int16).view(-1, 2)
    return pairs[:, _LOW], pairs[:, _HIGH]
