"""bf16 moments (``state_precision="bf16"``): torch's cast, rounding to nearest even, or,
with ``stochastic=True``, stochastic rounding (unbiased; reproducible from the
``torch.Generator`` given)."""

from __future__ import annotations

import torch

from tierswap.optim.formats._arrays import (
    CANONICAL_NAN_BITS,
    PIECE,
    as_flat,
    out_or_new,
    pieces,
    work_arrays,
)

__all__ = ["decode_bf16", "encode_bf16"]


def encode_bf16(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 into ``out`` (returned): to nearest even, or stochastically.

    Stochastic rounding rounds away from zero with probability (dropped low 16 bits) / 2**16,
    so its expectation is ``x``; the draws come from ``generator`` (torch's default one when
    ``None``), so a seeded generator makes it reproducible. NaN stays NaN.
    """
    src = as_flat(x, torch.float32, "x")
    dst = out_or_new(out, src.numel(), torch.bfloat16, "out", src.device)
    if not stochastic:
        return dst.copy_(src)
    src_bits = src.view(torch.int32)
    noise, nan = work_arrays(min(src.numel(), PIECE), src.device, torch.int32, torch.bool)
    for lo, hi in pieces(src.numel(), 1):
        bits, is_nan = noise[: hi - lo], nan[: hi - lo]
        bits.random_(0, 1 << 16, generator=generator)
        # (x + u) truncated, u uniform in [0, 2**16): carries into bf16's last bit with the
        # probability the dropped bits give. A NaN's carry could wrap its bits, so it is reset.
        bits.add_(src_bits[lo:hi]).bitwise_and_(-(1 << 16))
        torch.ne(src[lo:hi], src[lo:hi], out=is_nan)
        bits.masked_fill_(is_nan, CANONICAL_NAN_BITS)
        dst[lo:hi].copy_(bits.view(torch.float32))  # exact: the low 16 bits are zero
    return dst


def decode_bf16(stored: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``stored`` as fp32 into ``out`` (returned); exact."""
    src = as_flat(stored, torch.bfloat16, "stored")
    return out_or_new(out, src.numel(), torch.float32, "out", src.device).copy_(src)
