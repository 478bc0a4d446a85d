"""Compact optimizer state: bf16 and block-wise 8-bit moments, exact bf16 master remainders.

A public module: benches and users may run these numerics on their own tensors (e.g. to see
what a format does to their moments). The numerics of ``state_precision`` and
``master="remainder"``, on flat tensors; the optimizer's
slice step decodes a slice's stored arrays into fp32, runs torch's kernel on them and encodes the
result back. Every function writes into arrays the caller passes (``out=``) when given
(returning them as flat views; new 1-D tensors otherwise) and works through them in pieces of
at most ``_PIECE`` elements, so its temporaries stay small whatever the slice size. The
functions keep no state (the maps and tables they look up are computed once and never
written), so threads may run them at once on different arrays.

Moments (``state_precision``)
-----------------------------
- ``"fp32"``: stored as is; exact (the default).
- ``"bf16"``: torch's cast (round to nearest even) or, with ``stochastic=True``, stochastic
  rounding (unbiased; reproducible from the ``torch.Generator`` given).
- ``"8bit"``: block-wise dynamic quantisation (Dettmers et al., *8-bit Optimizers via Block-wise
  Quantization*, as in bitsandbytes and torchao's ``AdamW8bit``): each block of ``block_size``
  elements (a power of two) is divided by its largest magnitude (``absmax``) and each quotient
  replaced by the index of the nearest entry of a 256-entry dynamic map: signed for moments
  that change sign, unsigned (finer) for the ones that never do (``exp_avg_sq``). Stored as
  ``uint8`` codes (``numel``) and ``fp32`` absmax (``ceil(numel / block_size)``); a range that
  starts and ends at block boundaries (or at the tensor's end) encodes and decodes on its own.
  Tensors under ``MIN_8BIT_NUMEL`` elements stay fp32, as both libraries keep them.

Why not call torchao's quantizer: the tests compare this one with torchao's
(``torchao.optim.quant_utils``: same map, codes, scales and dequantised values), which runs on
the CPU, but torchao is no dependency of tierswap, importing it on a CPU-only torch tries (and
loudly fails) to load CUDA extensions, and ``quantize_8bit_with_qmap`` returns new tensors after
eight gather passes with int64 temporaries the size of the input. Here one look-up in a table
worked out once and a few integer passes write the same codes into the caller's array, tens of
times faster (``bench/codec.py`` times each codec against an fp32 copy). Two
deliberate differences: torchao floors the scale at ``1e-12``, which coarsens second moments
whose block maximum is under ``1e-12`` (gradients under ``1e-6``), where this floor is the
smallest normal fp32, there only to keep ``0 / 0`` out; and the last block may be partial
(torchao needs ``numel % block_size == 0``). bitsandbytes was not needed: torchao's map is a
copy of its ``create_dynamic_map``. A block that holds ``inf`` or ``nan`` decodes to
non-finite values.

Master remainders (``master="remainder"``)
------------------------------------------
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
A NaN master gives a NaN parameter and joins to a NaN, its payload not always kept.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

import numpy as np
import torch

from tierswap.errors import ConfigError, InvalidTensorError

__all__ = [
    "BLOCK_SIZE",
    "MIN_8BIT_NUMEL",
    "MasterFormat",
    "MomentFormat",
    "StatePrecision",
    "StoredArray",
    "bytes_per_element",
    "check_master",
    "check_precision",
    "decode_8bit",
    "decode_bf16",
    "encode_8bit",
    "encode_bf16",
    "is_moment",
    "is_unsigned",
    "join",
    "master_arrays",
    "num_blocks",
    "quantization_map",
    "round_half_up_bf16",
    "split",
    "stored_arrays",
]

StatePrecision = Literal["fp32", "bf16", "8bit"]
MasterFormat = Literal["fp32", "remainder"]

#: Elements per 8-bit block (torchao's and bitsandbytes' optimizers use 256 too).
BLOCK_SIZE = 256
#: Smaller tensors keep fp32 moments under ``"8bit"`` (biases, norms: cheap, and most sensitive).
MIN_8BIT_NUMEL = 4096
#: Moments torch's optimizers keep that are never negative: they get the unsigned map.
_UNSIGNED_STATES = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "sum"}
    | {"row_var", "col_var", "variance"}
)
#: State that torch's per-element optimizers keep as running statistics of the gradient (the
#: moments :func:`is_moment` names): what a compact ``state_precision`` applies to. Any other
#: per-element state (ASGD's parameter average ``ax``, Rprop's ``prev`` gradient and per-element
#: ``step_size``, a custom optimizer's) is not a moment: an optimizer keeping such state keeps
#: all of its state in fp32, exactly.
_MOMENTS = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer"}
    | {"square_avg", "grad_avg", "acc_delta", "sum"}
)
_PIECE = 1 << 16  # elements per piece of work: temporaries stay at a few hundred KiB
_SCALE_FLOOR = torch.finfo(torch.float32).tiny
_CANONICAL_NAN_BITS = 0x7FC00000
_BF16_NAN_BITS = _CANONICAL_NAN_BITS >> 16
# Index of the low and high 16-bit half of an fp32 seen as two int16s.
_LOW, _HIGH = (0, 1) if sys.byteorder == "little" else (1, 0)


def check_precision(value: object) -> StatePrecision:
    """``value`` when it names a moment format, else :class:`ConfigError`."""
    if value not in get_args(StatePrecision):
        raise ConfigError(
            f"state_precision={value!r} is not a moment format; use one of "
            f"{list(get_args(StatePrecision))} ('fp32' is exact)"
        )
    return value  # type: ignore[return-value]


def check_master(value: object) -> MasterFormat:
    """``value`` when it names a master format, else :class:`ConfigError`."""
    if value not in get_args(MasterFormat):
        raise ConfigError(
            f"master={value!r} is not a master format; use one of {list(get_args(MasterFormat))}"
        )
    return value  # type: ignore[return-value]


def is_unsigned(state_name: str) -> bool:
    """Whether torch's optimizers keep state ``state_name`` non-negative (unsigned 8-bit map);
    names not known here get the signed map, which serves any sign."""
    return state_name in _UNSIGNED_STATES


def is_moment(state_name: str) -> bool:
    """Whether state ``state_name`` of torch's per-element optimizers is a moment (a running
    statistic of the gradient: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``sum``,
    ...), which a compact ``state_precision`` may store; other state stays fp32."""
    return state_name in _MOMENTS


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks (and absmax entries) of ``numel`` elements; the last block may be partial."""
    return -(-numel // block_size)


def bytes_per_element(precision: StatePrecision, block_size: int = BLOCK_SIZE) -> float:
    """Stored bytes per element of one state tensor (``"8bit"``: the codes plus the scales)."""
    return {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 4.0 / block_size}[check_precision(precision)]


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One array stored for a state tensor: its name (an array key segment), dtype and length,
    and how many of the tensor's elements each of its elements stands for (``covers``: the
    block size for 8-bit scales, else 1)."""

    name: str
    dtype: torch.dtype
    numel: int
    covers: int = 1


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How one state tensor is stored. Immutable and stateless, so safe to share across threads;
    :meth:`encode` and :meth:`decode` write only the arrays they are given.

    ``signed`` picks the 8-bit map; ``stochastic`` makes ``"bf16"`` round stochastically.
    """

    precision: StatePrecision = "fp32"
    signed: bool = True
    block_size: int = BLOCK_SIZE
    stochastic: bool = False

    def __post_init__(self) -> None:
        check_precision(self.precision)
        _check_block_size(self.block_size)

    @classmethod
    def for_state(
        cls,
        state_name: str,
        numel: int,
        precision: StatePrecision,
        *,
        block_size: int = BLOCK_SIZE,
        stochastic: bool = False,
    ) -> MomentFormat:
        """The format of state ``state_name`` of a parameter of ``numel`` elements: the map's
        sign from the name, fp32 for ``"8bit"`` tensors under :data:`MIN_8BIT_NUMEL`."""
        if check_precision(precision) == "8bit" and numel < MIN_8BIT_NUMEL:
            precision = "fp32"
        return cls(precision, not is_unsigned(state_name), block_size, stochastic)

    def arrays(self, state_name: str, numel: int) -> list[StoredArray]:
        """The arrays that store state ``state_name`` of ``numel`` elements, in the order
        :meth:`encode` and :meth:`decode` take them."""
        if self.precision == "8bit":
            return [
                StoredArray(f"{state_name}.codes", torch.uint8, numel),
                StoredArray(
                    f"{state_name}.absmax",
                    torch.float32,
                    num_blocks(numel, self.block_size),
                    self.block_size,
                ),
            ]
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        return [StoredArray(state_name, dtype, numel)]

    def array_ranges(self, start: int, end: int, numel: int) -> list[tuple[int, int]]:
        """The ranges of each stored array that hold elements ``[start, end)`` of a tensor of
        ``numel``: 8-bit ranges must start at a block boundary and end at one or at ``numel``."""
        if not 0 <= start <= end <= numel:
            raise InvalidTensorError(f"range [{start}, {end}) is not inside [0, {numel})")
        if self.precision != "8bit":
            return [(start, end)]
        block = self.block_size
        if start % block or (end % block and end != numel):
            raise InvalidTensorError(
                f"range [{start}, {end}) of an 8-bit state cuts a block of {block} elements; "
                f"start and end at multiples of {block} (or end at the tensor's end, {numel})"
            )
        return [(start, end), (start // block, num_blocks(end, block))]

    def encode(
        self,
        x: torch.Tensor,
        stored: Sequence[torch.Tensor],
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        """Store fp32 ``x`` into ``stored`` (arrays as :meth:`arrays` lists, or their ranges
        from :meth:`array_ranges`); ``generator`` feeds stochastic rounding."""
        _check_count(stored, 2 if self.precision == "8bit" else 1)
        if self.precision == "8bit":
            encode_8bit(x, stored[0], stored[1], signed=self.signed, block_size=self.block_size)
        elif self.precision == "bf16":
            encode_bf16(x, stored[0], stochastic=self.stochastic, generator=generator)
        else:
            _flat(stored[0], torch.float32, "stored").copy_(_flat(x, torch.float32, "x"))

    def decode(self, stored: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``stored`` written into ``out`` (returned)."""
        _check_count(stored, 2 if self.precision == "8bit" else 1)
        if self.precision == "8bit":
            decode_8bit(stored[0], stored[1], out, signed=self.signed, block_size=self.block_size)
        elif self.precision == "bf16":
            decode_bf16(stored[0], out)
        else:
            _flat(out, torch.float32, "out").copy_(_flat(stored[0], torch.float32, "stored"))
        return out


def stored_arrays(
    state_name: str, numel: int, precision: StatePrecision, block_size: int = BLOCK_SIZE
) -> list[StoredArray]:
    """The arrays storing state ``state_name`` (``"exp_avg"``) of a ``numel``-element parameter
    under ``precision``: :meth:`MomentFormat.arrays` of :meth:`MomentFormat.for_state`."""
    fmt = MomentFormat.for_state(state_name, numel, precision, block_size=block_size)
    return fmt.arrays(state_name, numel)


def master_arrays(numel: int, master: MasterFormat) -> list[StoredArray]:
    """The arrays storing the master of a ``numel``-element bf16 parameter: the fp32 ``master``,
    or the int16 ``remainder`` that :func:`join` adds to the parameter."""
    if check_master(master) == "remainder":
        return [StoredArray("remainder", torch.int16, numel)]
    return [StoredArray("master", torch.float32, numel)]


# --- bf16 --------------------------------------------------------------------------------------


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
    src = _flat(x, torch.float32, "x")
    dst = _result(out, src.numel(), torch.bfloat16, "out", src.device)
    if not stochastic:
        return dst.copy_(src)
    src_bits = src.view(torch.int32)
    noise, nan = _scratch(min(src.numel(), _PIECE), src.device, torch.int32, torch.bool)
    for lo, hi in _pieces(src.numel(), 1):
        bits, is_nan = noise[: hi - lo], nan[: hi - lo]
        bits.random_(0, 1 << 16, generator=generator)
        # (x + u) truncated, u uniform in [0, 2**16): carries into bf16's last bit with the
        # probability the dropped bits give. A NaN's carry could wrap its bits, so it is reset.
        bits.add_(src_bits[lo:hi]).bitwise_and_(-(1 << 16))
        torch.ne(src[lo:hi], src[lo:hi], out=is_nan)
        bits.masked_fill_(is_nan, _CANONICAL_NAN_BITS)
        dst[lo:hi].copy_(bits.view(torch.float32))  # exact: the low 16 bits are zero
    return dst


def decode_bf16(stored: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``stored`` as fp32 into ``out`` (returned); exact."""
    src = _flat(stored, torch.bfloat16, "stored")
    return _result(out, src.numel(), torch.float32, "out", src.device).copy_(src)


# --- 8-bit -------------------------------------------------------------------------------------


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
    _check_block_size(block_size)
    src = _flat(x, torch.float32, "x")
    n = src.numel()
    codes_out = _result(codes, n, torch.uint8, "codes", src.device)
    absmax_out = _result(absmax, num_blocks(n, block_size), torch.float32, "absmax", src.device)
    dtypes = (torch.float32, torch.int32, torch.int32)
    scaled, *scratch = _scratch(min(n, _piece_len(block_size)), src.device, *dtypes)
    for lo, hi in _pieces(n, block_size):
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
    _check_block_size(block_size)
    src = _flat(codes, torch.uint8, "codes")
    n = src.numel()
    scales = _flat(absmax, torch.float32, "absmax")
    if scales.numel() != num_blocks(n, block_size):
        raise InvalidTensorError(
            f"{n} codes in blocks of {block_size} need {num_blocks(n, block_size)} absmax "
            f"values, not {scales.numel()}; slice both at the same block boundary"
        )
    dst = _result(out, n, torch.float32, "out", src.device)
    qmap = quantization_map(signed).to(src.device)
    (index,) = _scratch(min(n, _piece_len(block_size)), src.device, torch.int32)
    for lo, hi in _pieces(n, block_size):
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


# --- master remainders -------------------------------------------------------------------------


def round_half_up_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with ties away from zero, into ``out`` (returned): the
    parameter :func:`split` makes (torch's cast rounds ties to even)."""
    src = _flat(x, torch.float32, "x")
    dst = _result(out, src.numel(), torch.bfloat16, "out", src.device)
    _split_bits(src, dst.view(torch.int16), None)
    return dst


def split(
    master: torch.Tensor,
    param: torch.Tensor | None = None,
    remainder: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` as a bf16 ``param`` (:func:`round_half_up_bf16`) and an int16
    ``remainder``, written into the tensors given (both returned); :func:`join` undoes it."""
    src = _flat(master, torch.float32, "master")
    param_out = _result(param, src.numel(), torch.bfloat16, "param", src.device)
    remainder_out = _result(remainder, src.numel(), torch.int16, "remainder", src.device)
    _split_bits(src, param_out.view(torch.int16), remainder_out)
    return param_out, remainder_out


def _split_bits(
    master: torch.Tensor, param_bits: torch.Tensor, remainder: torch.Tensor | None
) -> None:
    """``param_bits`` = the master's upper half, plus 1 where its lower half is ``>= 0x8000``
    (negative as int16), and bf16's NaN where the master is NaN (its upper half alone can be
    inf, plus 1 can wrap it to zero); ``remainder`` = the lower half."""
    low, high = _halves(master)
    carry, nan = _scratch(min(master.numel(), _PIECE), master.device, torch.int16, torch.bool)
    for lo, hi in _pieces(master.numel(), 1):
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
    param_bits = _flat(param, torch.bfloat16, "param").view(torch.int16)
    rem = _flat(remainder, torch.int16, "remainder")
    if rem.numel() != param_bits.numel():
        raise InvalidTensorError(
            f"remainder has {rem.numel()} elements for a param of {param_bits.numel()}; "
            "pass the remainder split() made for this parameter"
        )
    dst = _result(out, rem.numel(), torch.float32, "out", rem.device)
    dst_bits = dst.view(torch.int32)
    (shifted,) = _scratch(min(rem.numel(), _PIECE), rem.device, torch.int32)
    for lo, hi in _pieces(rem.numel(), 1):
        work = shifted[: hi - lo]
        work.copy_(param_bits[lo:hi]).bitwise_left_shift_(16)
        torch.add(work, rem[lo:hi], out=dst_bits[lo:hi])  # wraps as the bits of a sum should
    return dst


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 16 bits of each element of fp32 ``t``, as strided int16 views."""
    pairs = t.view(torch.int16).view(-1, 2)
    return pairs[:, _LOW], pairs[:, _HIGH]


# --- shared helpers ----------------------------------------------------------------------------


def _piece_len(block_size: int) -> int:
    return max(_PIECE // block_size, 1) * block_size


def _scratch(numel: int, device: torch.device, *dtypes: torch.dtype) -> list[torch.Tensor]:
    """Work arrays of ``numel`` elements, one per dtype."""
    return [torch.empty(numel, dtype=dtype, device=device) for dtype in dtypes]


def _pieces(numel: int, block_size: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``numel`` elements, each a whole number of blocks."""
    step = _piece_len(block_size)
    for lo in range(0, numel, step):
        yield lo, min(lo + step, numel)


def _check_block_size(block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ConfigError(
            f"block_size={block_size} is not a power of two; use one such as {BLOCK_SIZE}, "
            "so blocks align with chunks and slices"
        )


def _check_count(stored: Sequence[torch.Tensor], count: int) -> None:
    if len(stored) != count:
        raise InvalidTensorError(
            f"{len(stored)} stored arrays given where the format has {count}; pass them in the "
            "order MomentFormat.arrays lists"
        )


def _flat(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t`` as a flat view, checked: its dtype is ``dtype`` and its memory contiguous."""
    if t.dtype != dtype:
        raise InvalidTensorError(f"{what} is {t.dtype}; pass a {dtype} tensor")
    if not t.is_contiguous():
        raise InvalidTensorError(f"{what} is not contiguous; pass .contiguous() or a flat buffer")
    return t.view(-1)


def _result(
    out: torch.Tensor | None,
    numel: int,
    dtype: torch.dtype,
    what: str,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``out`` as a flat view when given (checked), else a new tensor of ``numel``."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    flat = _flat(out, dtype, what)
    if flat.numel() != numel:
        raise InvalidTensorError(f"{what} has {flat.numel()} elements; it needs {numel}")
    return flat
