"""8-bit moments (``state_precision="8bit"``): block-wise dynamic quantisation.

As in Dettmers et al., *8-bit Optimizers via Block-wise Quantization*, bitsandbytes and
torchao's ``AdamW8bit``: each block of ``block_size`` elements (a power of two) is divided by
its largest magnitude (``absmax``) and each quotient replaced by the index of the nearest entry
of a 256-entry dynamic map: signed for moments that change sign, unsigned (finer) for the ones
that never do (``exp_avg_sq``). Stored as ``uint8`` codes (``numel``) and ``fp32`` absmax
(``ceil(numel / block_size)``); a range that starts and ends at block boundaries (or at the
tensor's end) encodes and decodes on its own. Tensors under
:data:`~tierswap.optim.formats.MIN_8BIT_NUMEL` elements stay fp32, as both libraries keep them.

Why not call torchao's quantizer: the tests compare this one with torchao's
(``torchao.optim.quant_utils``: same map, codes, scales and dequantised values), which runs on
the CPU, but torchao is no dependency of tierswap, importing it on a CPU-only torch tries (and
loudly fails) to load CUDA extensions, and ``quantize_8bit_with_qmap`` returns new tensors after
eight gather passes with int64 temporaries the size of the input. Here one look-up in a table
worked out once and a few integer passes write the same codes into the caller's array, tens of
times faster (``bench/codec.py`` times each codec against an fp32 copy). On the CPU the same
arithmetic runs in C kernels (:mod:`~tierswap.optim.formats._native`), one pass per block,
bit for bit what the torch ops below compute, which serve CUDA tensors and machines without a
C compiler. Two
deliberate differences: torchao floors the scale at ``1e-12``, which coarsens second moments
whose block maximum is under ``1e-12`` (gradients under ``1e-6``), where this floor is the
smallest normal fp32, there only to keep ``0 / 0`` out; and the last block may be partial
(torchao needs ``numel % block_size == 0``). bitsandbytes was not needed: torchao's map is a
copy of its ``create_dynamic_map``. A block that holds ``inf`` or ``nan`` decodes to
non-finite values.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from tierswap.errors import ConfigError, InvalidTensorError
from tierswap.optim.formats._arrays import as_flat, out_or_new, piece_len, pieces, work_arrays
from tierswap.optim.formats._native import for_tensors

__all__ = [
    "BLOCK_SIZE",
    "check_block_size",
    "decode_8bit",
    "encode_8bit",
    "num_blocks",
    "quantization_map",
]

#: Elements per 8-bit block (torchao's and bitsandbytes' optimizers use 256 too).
BLOCK_SIZE = 256
_SCALE_FLOOR = torch.finfo(torch.float32).tiny


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks (and absmax entries) of ``numel`` elements; the last block may be partial."""
    return -(-numel // block_size)


def check_block_size(block_size: int) -> None:
    """:class:`ConfigError` unless ``block_size`` is a power of two."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ConfigError(
            f"block_size={block_size} is not a power of two; use one such as {BLOCK_SIZE}, "
            "so blocks align with chunks and slices"
        )


@functools.cache
def quantization_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values the 8-bit codes stand for (do not modify it): bitsandbytes'
    dynamic map (7 exponent bits, no zero padding), computed as torchao computes it."""
    max_exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        items = 2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1
        boundaries = torch.linspace(0.1, 1, items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


@functools.cache
def _thresholds(signed: bool) -> torch.Tensor:
    """For each pair of neighbouring map values ``lo < hi``, the least fp32 ``y`` that rounds to
    ``hi``: torchao rounds up when ``fl(y - lo) >= fl(fl(hi - lo) * 0.5)`` in fp32, and so the
    code of ``y`` is the number of thresholds ``<= y``."""
    qmap = quantization_map(signed).numpy()
    thresholds = np.empty(qmap.size - 1, dtype=np.float32)
    for i, (lo, hi) in enumerate(itertools.pairwise(qmap)):
        half = (hi - lo) * np.float32(0.5)
        y = lo + half
        while np.nextafter(y, lo) - lo >= half:
            y = np.nextafter(y, lo)
        while y - lo < half:
            y = np.nextafter(y, hi)
        thresholds[i] = y
    return torch.from_numpy(thresholds)


@functools.cache
def _code_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes by the upper 16 bits of a scaled value: the code of the least fp32 with those bits
    (uint8) and the one threshold above it that fp32s with those bits can reach (NaN if none).

    An upper half keeps 7 bits of mantissa, and neighbouring thresholds lie further apart than
    that resolves (checked here), so the code of ``y`` is ``base[h] + (y >= step[h])``: the
    count of thresholds ``<= y``, as ``torch.bucketize`` gives it, from two look-ups instead
    of a binary search (several times faster on the CPU).
    """
    thresholds = _thresholds(signed)
    top = torch.arange(1 << 16, dtype=torch.int32) << 16
    first, last = top.view(torch.float32), (top | 0xFFFF).view(torch.float32)
    last = torch.where(last.isnan(), first, last)  # ±inf's upper half also holds NaNs
    least, most = torch.minimum(first, last), torch.maximum(first, last)
    base = torch.bucketize(least, thresholds, right=True)
    above = torch.cat([thresholds, torch.full((2,), math.nan)])
    step = torch.where(above[base] <= most, above[base], math.nan)
    if (above[base + 1] <= most).any():  # pragma: no cover - a property of the map
        raise AssertionError("an upper 16-bit half spans two 8-bit thresholds")
    return base.to(torch.uint8), step


@functools.cache
def _code_offsets(signed: bool) -> torch.Tensor:
    """The codes of :func:`_code_tables` as one int32 look-up and integer adds.

    Write a scaled value's bits as an int32 ``b = (h << 16) + low`` (``h`` its upper half,
    read unsigned as the index, and ``low`` its lower 16 bits). Within one upper half the code
    is ``base[h]`` plus one where the value has reached the half's threshold, whose lower bits
    are ``t``: where ``low >= t`` for a positive value, ``low <= t`` for a negative one (its
    magnitude grows with ``low``). With ``k = b`` for a positive value and ``k = ~b`` (``-b -
    1``) for a negative one, both are ``(k + offset[h]) >> 16`` for the offsets below: the sum
    stays in ``[0, 2**24)``, so the code is its third byte. One gather and three integer
    passes instead of two gathers, a float comparison and an add.
    """
    base, step = _code_tables(signed)
    h = torch.arange(1 << 16, dtype=torch.int64)
    signed_h = torch.where(h >= 1 << 15, h - (1 << 16), h)
    has_step = ~step.isnan()
    step_low = step.view(torch.int32).to(torch.int64) & 0xFFFF
    code = base.to(torch.int64) << 16
    positive = code + (1 << 16) - torch.where(has_step, step_low, 1 << 16) - (signed_h << 16)
    negative = code + (1 << 16) + torch.where(has_step, step_low, -1) + (signed_h << 16) + 1
    return torch.where(signed_h >= 0, positive, negative).to(torch.int32)


def _nearest_codes(
    scaled: torch.Tensor, out: torch.Tensor, signed: bool, scratch: Sequence[torch.Tensor]
) -> None:
    """``out`` (uint8) = the codes of the map entries nearest to ``scaled`` (see
    :func:`_code_offsets`), with ``scratch`` two int32 arrays at least as long. ``scaled``
    is overwritten."""
    offsets = _code_offsets(signed).to(scaled.device)
    index, total = (t[: scaled.numel()] for t in scratch)
    bits = scaled.view(torch.int32)
    torch.bitwise_right_shift(bits, 16, out=index).bitwise_and_(0xFFFF)
    torch.index_select(offsets, 0, index, out=total)
    torch.bitwise_right_shift(bits, 31, out=index)  # ~b for negative b: b ^ (b >> 31)
    bits.bitwise_xor_(index)
    total.add_(bits).bitwise_right_shift_(16)
    out.copy_(total)


def encode_8bit(
    x: torch.Tensor,
    codes: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
    *,
    signed: bool = True,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` quantised block-wise into ``codes`` (uint8, ``numel``) and ``absmax`` (fp32,
    :func:`num_blocks`), both returned. Each block's largest magnitude is kept exactly and
    decodes exactly when it is positive (or under the unsigned map)."""
    check_block_size(block_size)
    src = as_flat(x, torch.float32, "x")
    n = src.numel()
    codes_out = out_or_new(codes, n, torch.uint8, "codes", src.device)
    absmax_out = out_or_new(absmax, num_blocks(n, block_size), torch.float32, "absmax", src.device)
    if (native := for_tensors(src, codes_out, absmax_out)) is not None:
        native.encode_8bit(src, _code_offsets(signed), codes_out, absmax_out, block_size)
        return codes_out, absmax_out
    dtypes = (torch.float32, torch.int32, torch.int32)
    scaled, *scratch = work_arrays(min(n, piece_len(block_size)), src.device, *dtypes)
    for lo, hi in pieces(n, block_size):
        blocks = absmax_out[lo // block_size : num_blocks(hi, block_size)]
        work = scaled[: hi - lo]
        torch.abs(src[lo:hi], out=work)
        _block_amax(work, blocks, block_size)
        blocks.clamp_min_(_SCALE_FLOOR)
        _block_div(src[lo:hi], blocks, work, block_size)
        _nearest_codes(work, codes_out[lo:hi], signed, scratch)
    return codes_out, absmax_out


def decode_8bit(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    signed: bool = True,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """fp32 values of ``codes`` and ``absmax`` (from :func:`encode_8bit`, or ranges of them
    that start at a block boundary) into ``out`` (returned)."""
    check_block_size(block_size)
    src = as_flat(codes, torch.uint8, "codes")
    n = src.numel()
    scales = as_flat(absmax, torch.float32, "absmax")
    if scales.numel() != num_blocks(n, block_size):
        raise InvalidTensorError(
            f"{n} codes in blocks of {block_size} need {num_blocks(n, block_size)} absmax "
            f"values, not {scales.numel()}; slice both at the same block boundary"
        )
    dst = out_or_new(out, n, torch.float32, "out", src.device)
    if (native := for_tensors(src, scales, dst)) is not None:
        native.decode_8bit(src, scales, quantization_map(signed), dst, block_size)
        return dst
    qmap = quantization_map(signed).to(src.device)
    (index,) = work_arrays(min(n, piece_len(block_size)), src.device, torch.int32)
    for lo, hi in pieces(n, block_size):
        idx = index[: hi - lo]
        idx.copy_(src[lo:hi])
        torch.index_select(qmap, 0, idx, out=dst[lo:hi])
        _block_mul(dst[lo:hi], scales[lo // block_size : num_blocks(hi, block_size)], block_size)
    return dst


def _blocks(t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as full blocks ``(k, block_size)`` and the partial last block (maybe empty)."""
    full = t.numel() // block_size * block_size
    return t[:full].view(-1, block_size), t[full:]


def _block_amax(values: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    full, tail = _blocks(values, block_size)
    torch.amax(full, dim=1, out=out[: full.shape[0]])
    if tail.numel():
        torch.amax(tail, dim=0, keepdim=True, out=out[full.shape[0] :])


def _block_div(src: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    (src_full, src_tail), (out_full, out_tail) = _blocks(src, block_size), _blocks(out, block_size)
    k = src_full.shape[0]
    torch.div(src_full, scales[:k, None], out=out_full)
    if src_tail.numel():
        torch.div(src_tail, scales[k:], out=out_tail)


def _block_mul(values: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    full, tail = _blocks(values, block_size)
    full.mul_(scales[: full.shape[0], None])
    if tail.numel():
        tail.mul_(scales[full.shape[0] :])
