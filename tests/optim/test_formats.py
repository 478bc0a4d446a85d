"""Compact state (tierswap.optim.formats): bf16 and 8-bit moments, exact master remainders."""

from __future__ import annotations

import math

import pytest
import torch

from tests.optim.format_inputs import HIGHS, moments
from tierswap.errors import ConfigError, InvalidTensorError
from tierswap.optim.formats import (
    BLOCK_SIZE,
    MIN_8BIT_NUMEL,
    MomentFormat,
    StoredArray,
    bytes_per_element,
    check_master,
    check_precision,
    decode_8bit,
    decode_bf16,
    encode_8bit,
    encode_bf16,
    join,
    master_arrays,
    num_blocks,
    quantization_map,
    round_half_up_bf16,
    split,
    stored_arrays,
)

NAN_BITS = 0x7FC00000


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(values: list[int]) -> torch.Tensor:
    """fp32 tensor with the given 32-bit patterns (ints in [0, 2**32))."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values]).to(torch.int32)


def _as_u32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


# --- 8-bit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_the_map_is_256_sorted_values_from_minus_one_or_zero_to_one(signed: bool) -> None:
    qmap = quantization_map(signed)
    assert qmap.dtype == torch.float32
    assert qmap.numel() == 256
    assert bool((qmap[1:] > qmap[:-1]).all())
    assert qmap[-1].item() == 1.0
    assert 0.0 in qmap.tolist()
    assert (qmap[0].item() < -0.99) if signed else (qmap[0].item() == 0.0)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [BLOCK_SIZE, 37 * BLOCK_SIZE, 5 * BLOCK_SIZE + 37, 1, 70_001])
def test_8bit_error_is_within_half_the_map_gap_of_each_value(signed: bool, numel: int) -> None:
    x = moments(numel, signed=signed)
    codes, absmax = encode_8bit(x, signed=signed)
    decoded = decode_8bit(codes, absmax, signed=signed)
    assert codes.dtype == torch.uint8
    assert codes.numel() == numel
    assert absmax.numel() == num_blocks(numel)
    scale = torch.repeat_interleave(absmax, BLOCK_SIZE)[:numel].double()
    scaled = x.double() / scale
    qmap = quantization_map(signed).double()
    # The gap of the map around each value; below the map's first value (only -1.0 under the
    # signed map) the error is the distance to that first value.
    right = torch.searchsorted(qmap, scaled).clamp(1, 255)
    half_gap = (qmap[right] - qmap[right - 1]) / 2
    below = (qmap[0] - scaled).clamp_min(0)
    # Plus a rounding of the fp32 product (decoded = map value * absmax): 2**-23 of absmax.
    bound = (torch.maximum(half_gap, below) + 2.0**-22) * scale
    assert bool(((decoded.double() - x.double()).abs() <= bound).all())
    # And so each block's error is within half the largest gap (plus the -1 corner).
    worst = max((qmap[1:] - qmap[:-1]).max().item() / 2, 1 + qmap[0].item())
    per_block = (decoded - x).abs().double() / scale
    assert per_block.max().item() <= worst + 2.0**-22


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_keeps_each_blocks_largest_magnitude_exactly(signed: bool) -> None:
    x = moments(8 * BLOCK_SIZE, signed=signed, seed=1).abs()
    codes, absmax = encode_8bit(x, signed=signed)
    decoded = decode_8bit(codes, absmax, signed=signed)
    assert torch.equal(absmax, x.view(-1, BLOCK_SIZE).amax(1))
    assert torch.equal(decoded.view(-1, BLOCK_SIZE).amax(1), absmax)


def test_8bit_blocks_of_zeros_decode_to_zero() -> None:
    x = torch.zeros(3 * BLOCK_SIZE + 5)
    x[BLOCK_SIZE : 2 * BLOCK_SIZE] = torch.linspace(-1, 1, BLOCK_SIZE)
    codes, absmax = encode_8bit(x)
    decoded = decode_8bit(codes, absmax)
    assert bool(torch.isfinite(absmax).all())
    assert torch.equal(decoded[:BLOCK_SIZE], x[:BLOCK_SIZE])
    assert torch.equal(decoded[2 * BLOCK_SIZE :], x[2 * BLOCK_SIZE :])


@pytest.mark.parametrize("signed", [True, False])
def test_a_range_from_a_block_boundary_encodes_and_decodes_on_its_own(signed: bool) -> None:
    numel = 9 * BLOCK_SIZE + 77
    x = moments(numel, signed=signed, seed=2)
    codes, absmax = encode_8bit(x, signed=signed)
    whole = decode_8bit(codes, absmax, signed=signed)
    fmt = MomentFormat("8bit", signed)
    for start, end in [(0, BLOCK_SIZE), (2 * BLOCK_SIZE, 7 * BLOCK_SIZE), (8 * BLOCK_SIZE, numel)]:
        (c0, c1), (a0, a1) = fmt.array_ranges(start, end, numel)
        part = decode_8bit(codes[c0:c1], absmax[a0:a1], signed=signed)
        assert torch.equal(part, whole[start:end])
        part_codes, part_absmax = encode_8bit(x[start:end], signed=signed)
        assert torch.equal(part_codes, codes[c0:c1])
        assert torch.equal(part_absmax, absmax[a0:a1])


def test_array_ranges_refuse_a_range_that_cuts_a_block() -> None:
    fmt = MomentFormat("8bit")
    numel = 4 * BLOCK_SIZE + 3
    assert fmt.array_ranges(BLOCK_SIZE, numel, numel) == [(BLOCK_SIZE, numel), (1, 5)]
    with pytest.raises(InvalidTensorError, match="cuts a block"):
        fmt.array_ranges(1, BLOCK_SIZE, numel)
    with pytest.raises(InvalidTensorError, match="cuts a block"):
        fmt.array_ranges(0, BLOCK_SIZE + 1, numel)
    with pytest.raises(InvalidTensorError, match="not inside"):
        fmt.array_ranges(0, numel + 1, numel)
    assert MomentFormat("bf16").array_ranges(3, 10, 12) == [(3, 10)]


def test_8bit_writes_into_the_arrays_given() -> None:
    x = moments(2 * BLOCK_SIZE, signed=True, seed=3).view(2, BLOCK_SIZE)
    codes = torch.full((2 * BLOCK_SIZE,), 7, dtype=torch.uint8)
    absmax = torch.zeros(2)
    out = torch.empty(2, BLOCK_SIZE)
    got_codes, got_absmax = encode_8bit(x, codes, absmax)
    assert got_codes.data_ptr() == codes.data_ptr()
    assert got_absmax.data_ptr() == absmax.data_ptr()
    assert decode_8bit(codes, absmax, out).data_ptr() == out.data_ptr()
    assert torch.equal(out.view(-1), decode_8bit(*encode_8bit(x.view(-1))))


def test_8bit_checks_its_arguments() -> None:
    x = torch.randn(2 * BLOCK_SIZE)
    with pytest.raises(InvalidTensorError, match="absmax values"):
        decode_8bit(torch.zeros(2 * BLOCK_SIZE, dtype=torch.uint8), torch.ones(3))
    with pytest.raises(InvalidTensorError, match="float32"):
        encode_8bit(x.double())
    with pytest.raises(InvalidTensorError, match="contiguous"):
        encode_8bit(x.view(2, -1).t())
    with pytest.raises(InvalidTensorError, match="needs"):
        encode_8bit(x, torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="power of two"):
        encode_8bit(x, block_size=100)
    with pytest.raises(ConfigError, match="power of two"):
        MomentFormat("8bit", block_size=0)


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_codes_scales_and_values_equal_torchaos(signed: bool) -> None:
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    assert torch.equal(qmap, quantization_map(signed))
    x = moments(1 << 16, signed=signed, seed=4)
    # Also every rounding boundary and its neighbours: ties must go the same way.
    boundaries = (qmap[1:] + qmap[:-1]) / 2
    edges = torch.cat([boundaries, *(torch.nextafter(boundaries, qmap[i:][:255]) for i in (0, 1))])
    edges = torch.cat([edges, qmap, torch.zeros(-(edges.numel() + 256) % BLOCK_SIZE)])
    edges.view(-1, BLOCK_SIZE)[:, 0] = 1.0  # blocks scaled by 1: the edges are quantised as is
    x = torch.cat([x, edges])
    scaled, scale = quant_utils.scale_tensor(x, BLOCK_SIZE)
    ao_codes = quant_utils.quantize_8bit_with_qmap(scaled, qmap)
    codes, absmax = encode_8bit(x, signed=signed)
    assert torch.equal(codes, ao_codes)
    assert torch.equal(absmax, scale)  # every block's max is above torchao's 1e-12 floor here
    ao_values = quant_utils.dequant_with_qmap(ao_codes, qmap, scale)
    assert torch.equal(decode_8bit(codes, absmax, signed=signed), ao_values)


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_codes_count_the_thresholds_below_for_any_bit_pattern(signed: bool) -> None:
    """The integer look-up against its definition (the number of rounding thresholds ``<=``
    the scaled value, which the torchao test above ties to torchao's rounding): random bit
    patterns of both signs in [-1, 1] (subnormals and -0.0 included, negative ones under the
    unsigned map too) and every upper 16-bit half with its extreme lower halves."""
    from tierswap.optim.formats._quant8 import _thresholds

    gen = _generator(7)
    random = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 18,), generator=gen, dtype=torch.int32)
    halves = torch.arange(1 << 16, dtype=torch.int32) << 16
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF], dtype=torch.int32)
    edges = (halves[:, None] | lows[None, :]).view(-1)
    y = torch.cat([random, edges]).view(torch.float32)
    y = y[(y.abs() <= 1) & (y.abs() > 0) | (y == 0)]  # finite, inside the map's range
    y = torch.cat([y, torch.zeros(-y.numel() % BLOCK_SIZE)])
    y.view(-1, BLOCK_SIZE)[:, 0] = 1.0  # each block scaled by 1: y is quantised as is
    codes, _ = encode_8bit(y, signed=signed)
    expected = torch.bucketize(y, _thresholds(signed), right=True)
    assert torch.equal(codes.long(), expected)


def test_a_non_finite_value_spoils_only_its_block() -> None:
    x = torch.randn(3 * BLOCK_SIZE)
    x[BLOCK_SIZE + 3] = math.nan
    decoded = decode_8bit(*encode_8bit(x))
    assert bool(torch.isnan(decoded[BLOCK_SIZE : 2 * BLOCK_SIZE]).all())
    assert bool(torch.isfinite(decoded[:BLOCK_SIZE]).all())
    assert bool(torch.isfinite(decoded[2 * BLOCK_SIZE :]).all())


# --- bf16 ----------------------------------------------------------------------------------------


def test_bf16_rounds_to_nearest_even_like_torch_and_decodes_exactly() -> None:
    x = torch.cat([torch.randn(10_000), torch.tensor([math.inf, -math.inf, 0.0, -0.0, 1e-40])])
    stored = encode_bf16(x)
    assert torch.equal(stored.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(decode_bf16(stored), stored.float())
    assert bool(torch.isnan(encode_bf16(torch.tensor([math.nan]))).all())


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of ``x`` (towards and away from zero), as fp32."""
    toward = x.view(torch.int32) & -(1 << 16)
    return toward.view(torch.float32), (toward + (1 << 16)).view(torch.float32)


def test_stochastic_bf16_lands_on_a_neighbour_and_is_reproducible() -> None:
    x = torch.randn(50_000) * torch.pow(10.0, torch.empty(50_000).uniform_(-30, 30))
    first = encode_bf16(x, stochastic=True, generator=_generator(7)).float()
    toward, away = _bf16_neighbours(x)
    assert bool(((first == toward) | (first == away)).all())
    again = encode_bf16(x, stochastic=True, generator=_generator(7)).float()
    assert torch.equal(first, again)
    assert not torch.equal(first, encode_bf16(x, stochastic=True, generator=_generator(8)).float())
    exact = toward[:100]
    assert torch.equal(encode_bf16(exact, stochastic=True, generator=_generator(9)).float(), exact)


def test_stochastic_bf16_is_unbiased() -> None:
    draws = 4096
    gen = _generator(11)
    values = torch.randn(256, generator=gen) * torch.pow(10.0, torch.randint(-20, 20, (256,)))
    values[:4] = torch.tensor([1.0, -1.0, 3.0, -3.0]) * (1 + 2.0**-10)  # 1/8 of a bf16 step up
    x = values.repeat_interleave(draws)
    rounded = encode_bf16(x, stochastic=True, generator=gen).double().view(-1, draws)
    toward, away = _bf16_neighbours(values)
    ulp = (away.double() - toward.double()).abs()
    # A draw's error has standard deviation <= ulp / 2, so the mean's is <= ulp / (2 sqrt(draws))
    # = ulp / 128; six of them, for 256 values, fail with probability ~1e-6 for a random seed.
    bias = (rounded.mean(1) - values.double()).abs() / ulp
    assert bias.max().item() < 6 / 128
    nearest = encode_bf16(values[:4]).double()
    assert ((nearest - values[:4].double()).abs() / ulp[:4]).min().item() > 0.1  # RNE is biased


def test_stochastic_bf16_keeps_nan_and_inf() -> None:
    special = _bits([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0x7F800000, 0xFF800000])
    x = special.view(torch.float32).repeat(1000)
    rounded = encode_bf16(x, stochastic=True, generator=_generator(1)).float().view(-1, 6)
    assert bool(torch.isnan(rounded[:, :4]).all())
    assert bool((rounded[:, 4] == math.inf).all())
    assert bool((rounded[:, 5] == -math.inf).all())


# --- master remainders --------------------------------------------------------------------------


def _expected_split(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter and remainder bits of fp32 bit patterns (uint32 in int64), by integers."""
    high, low = bits >> 16, bits & 0xFFFF
    up = (low >= 0x8000).long()
    param = (high + up) & 0xFFFF
    return param, low - (up << 16)


def _check_split_join(bits: torch.Tensor) -> None:
    """split/join of every non-NaN pattern in ``bits`` (uint32 in int64) against integer math."""
    master = bits.to(torch.int32).view(torch.float32)
    master = master[~torch.isnan(master)]
    bits = _as_u32(master)
    param, remainder = split(master)
    want_param, want_remainder = _expected_split(bits)
    assert torch.equal(param.view(torch.int16).long() & 0xFFFF, want_param)
    assert torch.equal(remainder.long(), want_remainder)
    assert torch.equal(_as_u32(join(param, remainder)), bits)
    # The parameter is torch's round-to-nearest-even cast except at ties to an even neighbour,
    # where it is one bf16 step further from zero.
    rne = master.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    tie_up = ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)
    assert torch.equal(want_param, torch.where(tie_up, rne + 1, rne))
    assert torch.equal(round_half_up_bf16(master).view(torch.int16), param.view(torch.int16))


def test_split_join_is_exact_on_random_bits() -> None:
    gen = _generator(5)
    bits = torch.randint(0, 1 << 32, (1 << 20,), generator=gen, dtype=torch.int64)
    _check_split_join(bits)


@pytest.mark.parametrize("high", HIGHS)
def test_split_join_is_exact_for_every_low_half(high: int) -> None:
    """All 2**16 lower halves: ties, values that round up to the next exponent or to inf."""
    _check_split_join((high << 16) + torch.arange(1 << 16, dtype=torch.int64))


@pytest.mark.parametrize("low", [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_split_join_is_exact_for_every_high_half(low: int) -> None:
    """Ties (0x8000) and their neighbours under every sign, exponent and upper mantissa."""
    _check_split_join((torch.arange(1 << 16, dtype=torch.int64) << 16) + low)


def test_ties_round_away_from_zero() -> None:
    one_and_half_step = 1.0 + 2.0**-8  # halfway between bf16 1.0 and 1.0 + 2**-7
    master = torch.tensor([one_and_half_step, -one_and_half_step, 1.0 + 3 * 2.0**-8])
    param, _ = split(master)
    assert param.float().tolist() == [1.0 + 2.0**-7, -(1.0 + 2.0**-7), 1.0 + 2 * 2.0**-7]
    assert master.to(torch.bfloat16).float().tolist() == [1.0, -1.0, 1.0 + 2 * 2.0**-7]


def test_infinities_and_values_beyond_bf16_keep_the_master() -> None:
    master = _bits([0x7F800000, 0xFF800000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FC000]).view(torch.float32)
    param, remainder = split(master)
    assert param.float().tolist() == [math.inf, -math.inf, math.inf, math.inf, -math.inf]
    assert param.float().tolist() == master.to(torch.bfloat16).float().tolist()
    assert remainder.tolist()[:2] == [0, 0]
    assert torch.equal(join(param, remainder).view(torch.int32), master.view(torch.int32))


def test_a_nan_master_gives_a_nan_parameter_and_joins_to_nan() -> None:
    nans = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F808000, 0x7FFF8000, 0xFFFFFFFF, 0x7FFFFFFF]
    master = _bits(nans).view(torch.float32)
    param, remainder = split(master)
    assert bool(torch.isnan(param).all())
    assert bool(torch.isnan(round_half_up_bf16(master)).all())
    assert bool(torch.isnan(join(param, remainder)).all())


def test_split_and_join_write_into_the_tensors_given() -> None:
    master = torch.randn(3, 5)
    param = torch.empty(3, 5, dtype=torch.bfloat16)
    remainder = torch.empty(15, dtype=torch.int16)
    out = torch.empty(3, 5)
    got_param, got_remainder = split(master, param, remainder)
    assert got_param.data_ptr() == param.data_ptr()
    assert got_remainder.data_ptr() == remainder.data_ptr()
    assert join(param, remainder, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, master)
    with pytest.raises(InvalidTensorError, match="remainder has"):
        join(param, remainder[:3])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_split_join_is_exact_for_every_fp32() -> None:
    """All 2**32 patterns: join(split(m)) == m bitwise unless m is NaN, where both are NaN; the
    parameter is torch's cast, one step away from zero at ties to even. 90 s on 2 cores."""
    step = 1 << 22
    param = torch.empty(step, dtype=torch.bfloat16)
    remainder = torch.empty(step, dtype=torch.int16)
    back = torch.empty(step)
    for start in range(-(1 << 31), 1 << 31, step):
        bits = torch.arange(start, start + step, dtype=torch.int32)
        master = bits.view(torch.float32)
        split(master, param, remainder)
        join(param, remainder, back)
        nan = torch.isnan(master)
        assert bool(((back.view(torch.int32) == bits) | (nan & torch.isnan(back))).all())
        tie_up = ((bits & 0xFFFF) == 0x8000) & ((bits & 0x10000) == 0)
        want = master.to(torch.bfloat16).view(torch.int16) + tie_up
        assert bool(((param.view(torch.int16) == want) | (nan & torch.isnan(param))).all())


# --- the formats' arrays ------------------------------------------------------------------------


def test_stored_arrays_list_each_formats_arrays() -> None:
    numel = 10 * BLOCK_SIZE + 1 + MIN_8BIT_NUMEL
    assert stored_arrays("exp_avg", numel, "fp32") == [StoredArray("exp_avg", torch.float32, numel)]
    assert stored_arrays("exp_avg", numel, "bf16") == [
        StoredArray("exp_avg", torch.bfloat16, numel)
    ]
    assert stored_arrays("exp_avg_sq", numel, "8bit") == [
        StoredArray("exp_avg_sq.codes", torch.uint8, numel),
        StoredArray("exp_avg_sq.absmax", torch.float32, num_blocks(numel), covers=BLOCK_SIZE),
    ]
    small = MIN_8BIT_NUMEL - 1
    assert stored_arrays("exp_avg", small, "8bit") == [StoredArray("exp_avg", torch.float32, small)]
    assert master_arrays(numel, "remainder") == [StoredArray("remainder", torch.int16, numel)]
    assert master_arrays(numel, "fp32") == [StoredArray("master", torch.float32, numel)]
    assert [bytes_per_element(p) for p in ("fp32", "bf16", "8bit")] == [4, 2, 1 + 4 / BLOCK_SIZE]


def test_formats_by_state_name() -> None:
    assert MomentFormat.for_state("exp_avg", MIN_8BIT_NUMEL, "8bit") == MomentFormat("8bit", True)
    assert not MomentFormat.for_state("exp_avg_sq", MIN_8BIT_NUMEL, "8bit").signed
    assert MomentFormat.for_state("max_exp_avg_sq", 1, "8bit") == MomentFormat("fp32", False)
    assert MomentFormat.for_state("momentum_buffer", 1, "bf16").signed


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq"])
def test_a_format_round_trips_through_the_arrays_it_lists(precision: str, state: str) -> None:
    numel = MIN_8BIT_NUMEL + 3 * BLOCK_SIZE + 11
    fmt = MomentFormat.for_state(state, numel, check_precision(precision))
    x = moments(numel, signed=fmt.signed, seed=6)
    stored = [torch.empty(a.numel, dtype=a.dtype) for a in fmt.arrays(state, numel)]
    fmt.encode(x, stored)
    decoded = fmt.decode(stored, torch.empty(numel))
    tolerance = {"fp32": 0.0, "bf16": 2.0**-8, "8bit": 0.08}[precision]
    scale = x.abs().view(-1)
    assert bool(((decoded - x).abs() <= tolerance * scale.max()).all())
    if precision == "fp32":
        assert torch.equal(decoded, x)
    with pytest.raises(InvalidTensorError, match="stored arrays"):
        fmt.decode([*stored, stored[0]], torch.empty(numel))


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"\['fp32', 'bf16', '8bit'\]"):
        check_precision("int8")
    with pytest.raises(ConfigError, match="remainder"):
        check_master("bf16")
    with pytest.raises(ConfigError):
        MomentFormat("fp16")  # type: ignore[arg-type]
