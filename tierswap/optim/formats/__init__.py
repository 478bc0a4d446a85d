"""Compact optimizer state: bf16 and block-wise 8-bit moments, exact bf16 master remainders.

A public module: benches and users may run these numerics on their own tensors (e.g. to see
what a format does to their moments). The numerics of ``state_precision`` and
``master="remainder"``, on flat tensors; the optimizer's
slice step decodes a slice's stored arrays into fp32, runs torch's kernel on them and encodes the
result back. Every function writes into arrays the caller passes (``out=``) when given
(returning them as flat views; new 1-D tensors otherwise) and works through them in pieces of
at most ``PIECE`` elements (``_arrays``), so its temporaries stay small whatever the slice size. The
functions keep no state (the maps and tables they look up are computed once and never
written), so threads may run them at once on different arrays.

Moments (``state_precision``): ``"fp32"`` stored as is, exact (the default);
``"bf16"`` (:mod:`~tierswap.optim.formats._bf16`); ``"8bit"``, block-wise dynamic
quantisation (:mod:`~tierswap.optim.formats._quant8`, which says why it is not torchao's
quantizer). Exact master remainders of bf16 parameters (``master="remainder"``):
:mod:`~tierswap.optim.formats._remainder`. This module says how each state tensor is stored
(:class:`MomentFormat`, :class:`StoredArray`) and re-exports the codecs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from tierswap.errors import ConfigError, InvalidTensorError
from tierswap.optim.formats._arrays import as_flat, check_count
from tierswap.optim.formats._bf16 import decode_bf16, encode_bf16
from tierswap.optim.formats._quant8 import (
    BLOCK_SIZE,
    check_block_size,
    decode_8bit,
    encode_8bit,
    num_blocks,
    quantization_map,
)
from tierswap.optim.formats._remainder import join, round_half_up_bf16, split

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
        check_block_size(self.block_size)

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
        check_count(stored, 2 if self.precision == "8bit" else 1)
        if self.precision == "8bit":
            encode_8bit(x, stored[0], stored[1], signed=self.signed, block_size=self.block_size)
        elif self.precision == "bf16":
            encode_bf16(x, stored[0], stochastic=self.stochastic, generator=generator)
        else:
            as_flat(stored[0], torch.float32, "stored").copy_(as_flat(x, torch.float32, "x"))

    def decode(self, stored: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``stored`` written into ``out`` (returned)."""
        check_count(stored, 2 if self.precision == "8bit" else 1)
        if self.precision == "8bit":
            decode_8bit(stored[0], stored[1], out, signed=self.signed, block_size=self.block_size)
        elif self.precision == "bf16":
            decode_bf16(stored[0], out)
        else:
            as_flat(out, torch.float32, "out").copy_(as_flat(stored[0], torch.float32, "stored"))
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
