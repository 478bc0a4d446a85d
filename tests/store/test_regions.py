"""Region reads and writes: element ranges of a stored tensor, chunk by chunk."""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import tierswap as ts
from tests.store.faults import inject
from tierswap.errors import (
    CorruptionError,
    InvalidTensorError,
    KeyNotFoundError,
    OutOfSpaceError,
    RegionError,
)

CHUNK = 4096  # 1024 float32 elements per chunk
NUMEL = 5000  # five chunks, the last one partial


def _store(path: Path, durable: bool = True) -> ts.SwapStore:
    return ts.SwapStore(path, chunk_bytes=CHUNK, durable=durable)


@pytest.mark.parametrize("durable", [True, False])
def test_region_reads_match_slices(store_path: Path, durable: bool) -> None:
    value = torch.randn(NUMEL)
    rng = random.Random(1)
    regions = [(0, NUMEL), (0, 0), (1024, 2048), (1000, 1100), (3000, NUMEL), (4999, NUMEL)]
    regions += [tuple(sorted(rng.sample(range(NUMEL + 1), 2))) for _ in range(20)]
    with _store(store_path, durable) as store:
        store.put("x", value.view(50, 100))
        for start, stop in regions:
            assert torch.equal(store.get_region("x", start, stop), value[start:stop])
        out = torch.empty(300)
        assert store.get_region("x", 10, 310, out=out) is not None
        assert torch.equal(out, value[10:310])


@pytest.mark.parametrize("durable", [True, False])
def test_region_writes_update_only_their_range(store_path: Path, durable: bool) -> None:
    expected = torch.randn(NUMEL)
    rng = random.Random(2)
    with _store(store_path, durable) as store:
        store.put("x", expected.clone().view(50, 100))
        store.commit()
        for _ in range(25):
            start, stop = sorted(rng.sample(range(NUMEL + 1), 2))
            piece = torch.randn(stop - start)
            store.put_region("x", start, piece)
            expected[start:stop] = piece
            assert torch.equal(store.get("x").view(-1), expected)
        assert store.info("x").shape == (50, 100)
        store.commit()
    with ts.SwapStore(store_path, mode="r") as store:
        assert torch.equal(store.get("x").view(-1), expected)
        assert store.verify() == []
    raw = np.asarray(zarr.open_group(store_path, mode="r")["x"][:])
    assert torch.equal(torch.from_numpy(raw.copy()), expected)


def test_aligned_region_writes_read_nothing(store_path: Path) -> None:
    with _store(store_path) as store:
        store.put("x", torch.zeros(NUMEL))
        before = store.stats()
        store.put_region("x", 1024, torch.ones(2048))  # chunks 1 and 2, whole
        store.put_region("x", 4096, torch.ones(NUMEL - 4096))  # the partial last chunk, whole
        after = store.stats()
        assert after["bytes_read"] == before["bytes_read"]
        assert after["bytes_written"] - before["bytes_written"] == (2048 + NUMEL - 4096) * 4
        store.put_region("x", 10, torch.ones(10))  # part of chunk 0: read, then rewritten
        assert store.stats()["bytes_read"] - after["bytes_read"] == CHUNK


def test_bad_regions_are_refused_and_change_nothing(store_path: Path) -> None:
    value = torch.randn(NUMEL)
    with _store(store_path) as store:
        store.put("x", value)
        store.commit()
        for start, stop in [(-1, 10), (10, 5), (0, NUMEL + 1), (NUMEL + 1, NUMEL + 2)]:
            with pytest.raises(RegionError, match="not within its 5000 elements"):
                store.get_region("x", start, stop)
        with pytest.raises(RegionError):
            store.get_region("x", 1.5, 10)  # type: ignore[arg-type]
        with pytest.raises(RegionError):
            store.put_region("x", NUMEL - 5, torch.ones(10))
        with pytest.raises(InvalidTensorError, match=r"holds torch\.float32"):
            store.put_region("x", 0, torch.ones(10, dtype=torch.float64))
        with pytest.raises(InvalidTensorError, match="out="):
            store.get_region("x", 0, 10, out=torch.empty(11))
        with pytest.raises(KeyNotFoundError):
            store.get_region("missing", 0, 1)
        assert torch.equal(store.get("x"), value)
        assert store.verify() == []
        assert store.commit() == 2


def test_damaged_chunk_is_reported_by_region_reads(store_path: Path) -> None:
    value = torch.randn(NUMEL)
    with _store(store_path) as store:
        store.put("x", value)
        store.commit()
    chunk = store_path / "x" / "c" / "2"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with _store(store_path) as store:
        assert torch.equal(store.get_region("x", 0, 2048), value[:2048])
        with pytest.raises(CorruptionError, match="chunk 2"):
            store.get_region("x", 2100, 2200)
        # A partial write over the damaged chunk must not launder the damage into a new CRC.
        with pytest.raises(CorruptionError, match="chunk 2"):
            store.put_region("x", 2100, torch.ones(10))
        # A whole-chunk write replaces the damaged bytes outright.
        store.put_region("x", 2048, value[2048:3072])
        assert torch.equal(store.get("x"), value)


def test_failed_region_write_leaves_the_key_as_it_was(store_path: Path) -> None:
    value = torch.randn(NUMEL)
    with _store(store_path) as store:
        store.put("x", value)
        store.commit()
        store.put_region("x", 0, torch.zeros(1024))  # an uncommitted, staged version of chunk 0
        expected = value.clone()
        expected[:1024] = 0
        faulty = inject(  # the disk fills up from the third chunk of the next write on
            store,
            fail={"write_file": set(range(3, 100))},
            error=lambda: OSError(errno.ENOSPC, "No space left on device"),
        )
        with pytest.raises(OutOfSpaceError):
            store.put_region("x", 0, torch.ones(NUMEL))
        faulty.fail.clear()
        assert torch.equal(store.get("x"), expected)
        staged = sorted((store_path / ".tierswap" / "staging").iterdir())
        assert len(staged) == 1  # only the earlier region write's chunk; failures left nothing
    with _store(store_path) as store:  # never committed: the last commit is what reopens
        assert torch.equal(store.get("x"), value)
        assert store.verify() == []


def test_uncommitted_region_writes_vanish_on_reopen(store_path: Path) -> None:
    value = torch.randn(NUMEL)
    with _store(store_path) as store:
        store.put("x", value)
        store.commit()
        store.put_region("x", 1000, torch.ones(3000))
        store.put_region("x", 1000, torch.full((3000,), 2.0))  # replaces staged files again
        assert len(list((store_path / ".tierswap" / "staging").iterdir())) == 4
    with _store(store_path) as store:
        assert torch.equal(store.get("x"), value)


def test_create_allocates_zeros_without_writing(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="1MiB") as store:
        store.create("big", (4096, 1024), torch.float32)  # 16 MiB
        assert store.stats()["bytes_written"] == 0
        store.commit()
        assert store.disk_usage() < 1 << 20
        assert store.info("big").shape == (4096, 1024)
        assert torch.equal(store.get_region("big", 5, 1 << 20), torch.zeros((1 << 20) - 5))
        store.put_region("big", 1 << 18, torch.ones(1 << 18))
        store.commit()
        assert store.verify() == []
    group = zarr.open_group(store_path, mode="r")
    assert float(np.asarray(group["big"][(1 << 18) : (1 << 18) + 4]).sum()) == 4.0
    with pytest.raises(InvalidTensorError), ts.SwapStore(store_path) as store:
        store.create("bad", (-1,), torch.float32)


def test_an_array_may_have_a_chunk_size_of_its_own(store_path: Path) -> None:
    """``chunk_bytes`` of ``create``, ``put`` and ``put_many`` sets one array's chunking;
    regions, a reopened store and zarr-python follow each array's own."""
    from tierswap.errors import ConfigError

    value = torch.arange(8192.0)
    with ts.SwapStore(store_path, chunk_bytes="16KiB") as store:
        store.create("small", (8192,), torch.float32, chunk_bytes=CHUNK)
        store.put("own", value, chunk_bytes="8KiB")
        store.put_many({"a": value, "b": value}, chunk_bytes={"a": CHUNK})
        store.put_region("small", 1000, value[:3000])
        store.commit()
        chunks = {k: store.info(k).chunk_bytes for k in ("small", "own", "a", "b")}
        assert chunks == {"small": CHUNK, "own": 8192, "a": CHUNK, "b": 16384}
        with pytest.raises(ConfigError, match="multiple of 4096"):
            store.put("bad", value, chunk_bytes=1000)
    with ts.SwapStore(store_path) as store:
        assert store.info("small").chunk_bytes == CHUNK
        assert torch.equal(store.get_region("small", 1000, 4000), value[:3000])
        assert torch.equal(store.get_region("own", 2000, 6000), value[2000:6000])
        assert store.verify() == []
    group = zarr.open_group(store_path, mode="r")
    assert np.array_equal(np.asarray(group["a"][:]), value.numpy())
    assert float(np.asarray(group["small"][999:1001]).sum()) == 0.0


def test_concurrent_region_writes_of_one_key(store_path: Path) -> None:
    """Disjoint regions of one key written from several threads, then re-read while written."""
    expected = torch.zeros(16 * 1024)
    with _store(store_path) as store:
        store.put("x", expected)
        pieces = [(i * 1024, torch.full((1024,), float(i))) for i in range(16)]

        def write(part: list[tuple[int, torch.Tensor]]) -> None:
            for start, piece in part:
                store.put_region("x", start, piece)

        threads = [threading.Thread(target=write, args=(pieces[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for start, piece in pieces:
            expected[start : start + 1024] = piece
        assert torch.equal(store.get("x"), expected)
        # A read of a chunk waits for the write of that chunk started before it.
        futures = []
        for round_ in range(5):
            futures.append(store.put_region_async("x", 2048, torch.full((1024,), 100.0 + round_)))
            futures.append(store.get_region_async("x", 2048, 3072))
        reads = [f.result() for f in futures[1::2]]
        assert [float(r[0]) for r in reads] == [100.0, 101.0, 102.0, 103.0, 104.0]
        store.commit()
        assert store.verify() == []
