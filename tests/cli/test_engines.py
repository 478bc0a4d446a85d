"""Benchmark engines: each writes the source bytes durably and reads them back unchanged."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from tierswap.cli import _engines
from tierswap.cli._engines import (
    AiofilesEngine,
    DdEngine,
    FioEngine,
    StoreEngine,
    ZarrEngine,
    _segments,
    parse_fio_json,
)
from tierswap.cli._measure import random_source
from tierswap.config import IOConfig
from tierswap.errors import BenchmarkError, ConfigError
from tierswap.io import aligned_empty

SIZE = (3 << 20) + 12345  # not a whole number of blocks: the tail must survive


@pytest.fixture
def src() -> torch.Tensor:
    return random_source(SIZE, seed=7)


def _dst() -> torch.Tensor:
    return aligned_empty((SIZE,), torch.uint8, pin=False).fill_(0)


@pytest.mark.parametrize(("nbytes", "parts", "block"), [(10, 3, 4), (4096, 8, 4096), (100, 1, 64)])
def test_segments_cover_the_range_on_block_boundaries(nbytes: int, parts: int, block: int) -> None:
    segs = _segments(nbytes, parts, block)
    assert segs[0][0] == 0
    assert segs[-1][1] == nbytes
    assert len(segs) <= parts
    for (_, hi), (lo, _) in itertools.pairwise(segs):
        assert hi == lo
        assert lo % block == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_aiofiles_round_trip(tmp_path: Path, src: torch.Tensor, threads: int) -> None:
    dst = _dst()
    engine = AiofilesEngine(src, dst, block_bytes=1 << 20, threads=threads)
    assert engine.write(tmp_path) > 0
    assert (tmp_path / "data.bin").read_bytes() == src.numpy().tobytes()
    assert engine.read(tmp_path) > 0
    assert torch.equal(dst, src)


def test_zarr_round_trip_uses_zarr_arrays(tmp_path: Path, src: torch.Tensor) -> None:
    engine = ZarrEngine(src, block_bytes=1 << 20, threads=2)
    assert engine.write(tmp_path) > 0
    array = zarr.open_array(str(tmp_path / "zarr"), mode="r")
    assert array.chunks == (1 << 20,)
    assert array.compressors == ()
    np.testing.assert_array_equal(array[:], src.numpy())
    assert engine.read(tmp_path) > 0


FIO_SAMPLE = {
    "fio version": "fio-3.33",
    "jobs": [
        {
            "jobname": "tierswap-bench",
            "error": 0,
            "read": {"io_bytes": 0, "bw_bytes": 0, "runtime": 0},
            "write": {"io_bytes": 1 << 30, "bw_bytes": 1_600_000_000, "runtime": 671},
        }
    ],
}


def test_parse_fio_json_skips_leading_warnings() -> None:
    text = "fio: note: both iodepth >= 1 and synchronous I/O engine\n" + json.dumps(FIO_SAMPLE)
    text += "\nfio: file hash not empty on exit\n"
    assert parse_fio_json(text, "write") == 1.6e9
    with pytest.raises(BenchmarkError, match="moved no bytes"):
        parse_fio_json(text, "read")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "no JSON"),
        ('{"jobs": []}', "no job results"),
        (json.dumps({"jobs": [{"error": 5, "write": {"bw_bytes": 1}}]}), "error 5"),
    ],
)
def test_parse_fio_json_errors(text: str, message: str) -> None:
    with pytest.raises(BenchmarkError, match=message):
        parse_fio_json(text, "write")


def test_fio_command_matches_the_reference_settings(tmp_path: Path) -> None:
    cmd = FioEngine(1 << 30).command(tmp_path, "write")
    for flag in ("--direct=1", "--ioengine=libaio", "--iodepth=32", "--end_fsync=1"):
        assert flag in cmd
    assert "--bs=8388608" in cmd
    assert "--output-format=json" in cmd
    small = FioEngine(5 << 20).command(tmp_path, "read")  # below one 8 MiB block
    assert "--bs=5242880" in small
    assert "--size=5242880" in small


def test_missing_tool_is_a_benchmark_error(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="cannot run"):
        FioEngine(1 << 20, binary=str(tmp_path / "no-fio")).write(tmp_path)


def _direct_io_ok(folder: Path) -> bool:
    try:
        DdEngine(1 << 20).write(folder)
    except BenchmarkError:
        return False
    return True


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_runs_on_the_folder(tmp_path: Path) -> None:
    if not _direct_io_ok(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    engine = FioEngine(8 << 20)
    assert engine.write(tmp_path) > 0
    assert (tmp_path / "data.bin").stat().st_size == 8 << 20
    assert engine.read(tmp_path) > 0


@pytest.mark.skipif(shutil.which("dd") is None, reason="dd is not installed")
def test_dd_moves_whole_blocks(tmp_path: Path) -> None:
    if not _direct_io_ok(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    engine = DdEngine((2 << 20) + 100, block_bytes=1 << 20)
    assert engine.write(tmp_path) > 0
    assert (tmp_path / "data.bin").stat().st_size == 2 << 20
    assert engine.read(tmp_path) > 0
    with pytest.raises(BenchmarkError, match="below one 4096-byte block"):
        DdEngine(100).write(tmp_path)


@pytest.mark.parametrize("direct", ["on", "off"])
def test_store_engine_round_trip(tmp_path: Path, src: torch.Tensor, direct: str) -> None:
    dst = _dst()
    engine = StoreEngine(src, dst, IOConfig(block_bytes=1 << 20, threads=2, direct=direct))
    try:
        assert engine.write(tmp_path) > 0
    except BenchmarkError:
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    assert engine.direct_used is (direct == "on")
    assert engine.read(tmp_path) > 0
    assert torch.equal(dst, src)


def test_store_engine_turns_a_refused_o_direct_into_a_skip(
    tmp_path: Path, src: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise ConfigError("direct='on' but the filesystem rejects O_DIRECT")

    monkeypatch.setattr(_engines, "SwapStore", refuse)
    engine = StoreEngine(src, _dst(), IOConfig(direct="on"))
    with pytest.raises(BenchmarkError, match="rejects O_DIRECT"):
        engine.write(tmp_path)


def test_store_chunks_hold_at_least_one_block(src: torch.Tensor) -> None:
    small = StoreEngine(src, src, IOConfig(block_bytes=1 << 20))
    big = StoreEngine(src, src, IOConfig(block_bytes=32 << 20))
    assert (small.chunk_bytes, big.chunk_bytes) == (16 << 20, 32 << 20)
