"""The compact formats' C kernels (tierswap.optim.formats._native): bit for bit the torch ops'
results (8-bit codec, master remainders), built once per cache folder, and a clear fallback
where they cannot be built."""

from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.optim.format_inputs import HIGHS, moments
from tierswap.optim.formats import _native
from tierswap.optim.formats._quant8 import decode_8bit, encode_8bit, num_blocks
from tierswap.optim.formats._remainder import join, round_half_up_bf16, split

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache folder and no loaded kernels, restored afterwards."""
    monkeypatch.setenv("TIERSWAP_CACHE_DIR", str(tmp_path))
    _native.kernels.cache_clear()
    yield tmp_path
    _native.kernels.cache_clear()


def _torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "kernels", lambda: None)


def _values(numel: int, *, signed: bool, seed: int) -> torch.Tensor:
    """Moments over ten decades, with zeros, negative zeros and subnormals mixed in."""
    x = moments(numel, signed=True, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45])
    where = torch.randint(numel, (min(numel, 64),), generator=gen)
    x[where] = specials[torch.arange(where.numel()) % specials.numel()]
    return x if signed else x * x


def _encode_both(
    x: torch.Tensor, signed: bool, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    assert _native.kernels() is not None  # else both sides would be the torch ops
    kernel = encode_8bit(x, signed=signed, block_size=block_size)
    with monkeypatch.context() as mp:
        _torch_ops(mp)
        ops = encode_8bit(x, signed=signed, block_size=block_size)
    return kernel, ops


@needs_compiler
def test_the_kernels_load_where_a_compiler_is() -> None:
    assert _native.kernels() is not None


@needs_compiler
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize(
    ("numel", "block_size", "torch_threads"),
    [
        (1, 256, 4),
        (5 * 256 + 37, 256, 4),
        (600 * 256 + 5, 256, 4),  # split over two kernel threads, partial last block
        (800 * 256 + 77, 256, 6),  # three, of unequal length
        (700 * 256, 256, 1),
        (40 * 2048 + 1000, 2048, 4),  # blocks longer than the kernel's division span
        (3000, 64, 4),
    ],
)
def test_kernels_match_the_torch_ops_bit_for_bit(
    signed: bool, numel: int, block_size: int, torch_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _values(numel, signed=signed, seed=numel)
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads)  # the kernels take half
    try:
        (codes, absmax), (ref_codes, ref_absmax) = _encode_both(x, signed, block_size, monkeypatch)
        decoded = decode_8bit(codes, absmax, signed=signed, block_size=block_size)
        with monkeypatch.context() as mp:
            _torch_ops(mp)
            ref_decoded = decode_8bit(codes, absmax, signed=signed, block_size=block_size)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(absmax.view(torch.int32), ref_absmax.view(torch.int32))
    assert torch.equal(codes, ref_codes)
    assert torch.equal(decoded.view(torch.int32), ref_decoded.view(torch.int32))


@needs_compiler
def test_kernels_write_into_views_of_larger_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _values(600 * 256, signed=True, seed=1)
    codes = torch.full((2, x.numel()), 7, dtype=torch.uint8)
    absmax = torch.full((2, num_blocks(x.numel())), 7.0)
    encode_8bit(x, codes[1], absmax[1])
    (ref_codes, ref_absmax), _ = _encode_both(x, True, 256, monkeypatch)
    assert torch.equal(codes[1], ref_codes)
    assert torch.equal(absmax[1], ref_absmax)
    assert bool((codes[0] == 7).all())
    assert bool((absmax[0] == 7.0).all())


@needs_compiler
def test_blocks_with_inf_or_nan_agree_where_finite_and_decode_non_finite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = _values(8 * 256, signed=True, seed=2)
    x[3], x[256 + 9], x[512 + 4], x[512 + 5] = math.inf, math.nan, -math.inf, math.nan
    (codes, absmax), (ref_codes, ref_absmax) = _encode_both(x, True, 256, monkeypatch)
    assert torch.equal(absmax.isnan(), ref_absmax.isnan())
    finite = ref_absmax.isfinite()
    assert torch.equal(absmax[finite], ref_absmax[finite])
    every = finite.repeat_interleave(256)
    assert torch.equal(codes[every], ref_codes[every])
    decoded = decode_8bit(codes, absmax)
    assert not bool(decoded[:768].view(3, 256).isfinite().all(dim=1).any())
    assert bool(decoded[:256].isnan().any())
    assert bool(decoded[256:512].isnan().all())
    assert bool(decoded[768:].isfinite().all())


def _master_bits(torch_threads: int) -> torch.Tensor:
    """fp32 masters: every lower half under the upper halves of ``HIGHS`` and NaN ones, then
    random bits, enough to split over ``torch_threads // 2`` kernel threads."""
    uppers = [*HIGHS, 0x7FC0, 0x7FFF, 0xFFC0, 0xFFFF]
    low = torch.arange(1 << 16, dtype=torch.int64)
    grid = torch.cat([(u << 16) | low for u in uppers])
    randoms = torch.randint(0, 1 << 32, (70_001 * torch_threads,), dtype=torch.int64)
    return torch.cat([grid, randoms]).to(torch.int32).view(torch.float32)


@needs_compiler
@pytest.mark.parametrize("torch_threads", [1, 4, 6])
def test_remainder_kernels_match_the_torch_ops_bit_for_bit(
    torch_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _native.kernels() is not None
    master = _master_bits(torch_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        param, remainder = split(master)
        joined = join(param, remainder)
        rounded = round_half_up_bf16(master)
        with monkeypatch.context() as mp:
            _torch_ops(mp)
            ref_param, ref_remainder = split(master)
            ref_joined = join(ref_param, ref_remainder)
            ref_rounded = round_half_up_bf16(master)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(param.view(torch.int16), ref_param.view(torch.int16))
    assert torch.equal(remainder, ref_remainder)
    assert torch.equal(rounded.view(torch.int16), ref_rounded.view(torch.int16))
    assert torch.equal(joined.view(torch.int32), ref_joined.view(torch.int32))
    not_nan = ~master.isnan()
    assert torch.equal(joined.view(torch.int32)[not_nan], master.view(torch.int32)[not_nan])


def test_native_off_leaves_the_torch_ops(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSWAP_NATIVE", "0")
    assert _native.kernels() is None
    assert list(fresh_build.iterdir()) == []


def test_a_failed_build_warns_once_falls_back_and_leaves_no_files(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="could not build its C kernels"):
        assert _native.kernels() is None
    assert _native.kernels() is None  # cached: no second warning (warnings are errors here)
    x = _values(3 * 256, signed=True, seed=3)
    codes, absmax = encode_8bit(x)
    assert torch.equal(decode_8bit(codes, absmax), decode_8bit(codes, absmax))
    assert [p.name for p in fresh_build.iterdir()] == []


def test_a_cache_folder_that_cannot_be_made_falls_back(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = fresh_build / "a-file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("TIERSWAP_CACHE_DIR", str(blocker / "kernels"))
    with pytest.warns(RuntimeWarning, match=r"Errno \d+"):
        assert _native.kernels() is None
    assert [p.name for p in fresh_build.iterdir()] == ["a-file"]


@needs_compiler
def test_a_compiler_error_is_reported_and_leaves_no_files(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "cc -DTIERSWAP_BROKEN=1 -include /nonexistent/header.h")
    with pytest.warns(RuntimeWarning, match="error"):
        assert _native.kernels() is None
    assert list(fresh_build.iterdir()) == []


@needs_compiler
def test_builds_once_per_cache_folder_and_concurrent_builds_publish_whole_files(
    fresh_build: Path,
) -> None:
    target = _native.library_path()
    errors: list[BaseException] = []

    def build() -> None:
        try:
            _native.build(target)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in fresh_build.iterdir()] == [target.name]
    assert _native.kernels() is not None
    built = target.stat().st_mtime_ns
    _native.kernels.cache_clear()
    assert _native.kernels() is not None
    assert target.stat().st_mtime_ns == built  # loaded, not rebuilt


def test_the_compiler_is_cc_when_python_was_built_with_one_this_machine_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(_native.sysconfig, "get_config_var", lambda name: "no-such-cc -pthread")
    assert _native.build_command(Path("out"))[0] == "cc"
    monkeypatch.setenv("CC", "my-cc --flag")
    assert _native.build_command(Path("out"))[:2] == ["my-cc", "--flag"]


def test_a_missing_kernel_source_falls_back(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "_SOURCE", fresh_build / "no-such-source.c")
    with pytest.warns(RuntimeWarning, match="no-such-source"):
        assert _native.kernels() is None
    assert list(fresh_build.iterdir()) == []
