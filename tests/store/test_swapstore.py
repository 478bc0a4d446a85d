from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import tierswap as ts
from tierswap.errors import (
    ConfigError,
    CorruptionError,
    InvalidKeyError,
    InvalidTensorError,
    KeyNotFoundError,
    OutOfSpaceError,
    ReadOnlyError,
    StoreClosedError,
    StoreLockedError,
)
from tierswap.io import aligned_empty

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
SHAPES = [(), (0,), (1,), (3, 5), (2, 0, 4), (4097,), (3, 1000)]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_round_trip_every_dtype_and_shape(store_path: Path) -> None:
    values = {
        f"{str(dtype)[6:]}/{i}": _random(shape, dtype)
        for dtype in DTYPES
        for i, shape in enumerate(SHAPES)
    }
    with ts.SwapStore(store_path, chunk_bytes="8KiB") as store:
        for key, value in values.items():
            store.put(key, value)
        for key, value in values.items():  # uncommitted puts are visible in-process
            assert _same(store.get(key), value), key
        store.commit()
    with ts.SwapStore(store_path, mode="r") as store:
        assert sorted(values) == store.keys()
        for key, value in values.items():
            assert _same(store.get(key), value), key
            info = store.info(key)
            assert (info.dtype, info.shape) == (value.dtype, tuple(value.shape))


def test_non_contiguous_and_views(store_path: Path) -> None:
    base = torch.randn(64, 48)
    views = {
        "t": base.t(),
        "step": base[::3, 5:],
        "conj": torch.randn(7, dtype=torch.cfloat).conj(),
    }
    with ts.SwapStore(store_path) as store:
        for key, value in views.items():
            store.put(key, value)
            assert torch.equal(store.get(key), value.resolve_conj())


def test_multi_chunk_with_unaligned_tail(store_path: Path) -> None:
    value = torch.randn(3 * 4096 // 4 * 5 + 7)  # several chunks, a partial last page
    with ts.SwapStore(store_path, chunk_bytes="12KiB", io=ts.IOConfig(block_bytes=4096)) as s:
        s.put("x", value)
        assert s.info("x").nchunks == 6
        s.commit()
        assert torch.equal(s.get("x"), value)
        for chunk in sorted((store_path / "x" / "c").iterdir()):
            assert chunk.stat().st_size == 12 * 1024  # edge chunk padded, as zarr expects


@pytest.mark.parametrize("aligned", [True, False])
def test_get_into_caller_buffer(store_path: Path, aligned: bool) -> None:
    value = torch.randn(10_000)
    with ts.SwapStore(store_path, chunk_bytes="16KiB") as store:
        store.put("x", value)
        out = aligned_empty((10_000,), torch.float32) if aligned else torch.empty(10_001)[1:]
        got = store.get("x", out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, value)


def test_get_out_mismatch_is_rejected(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("x", torch.zeros(4, 4))
        with pytest.raises(InvalidTensorError, match="float32"):
            store.get("x", out=torch.empty(4, 4, dtype=torch.float64))
        with pytest.raises(InvalidTensorError, match="contiguous"):
            store.get("x", out=torch.empty(4, 4).t())
        with pytest.raises(InvalidTensorError, match=r"\(4, 4\)"):
            store.get("x", out=torch.empty(16))


def test_zarr_python_reads_committed_arrays(store_path: Path) -> None:
    values = {
        "layer0/weight": torch.randn(33, 17),
        "layer0/bias": torch.randn(17).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(100) > 0.5,
    }
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        for key, value in values.items():
            store.put(key, value)
        store.commit({"step": 3})
        store.put("uncommitted", torch.ones(3))
    group = zarr.open_group(store_path, mode="r")
    assert "uncommitted" not in group
    assert group.attrs["tierswap"]["meta"] == {"step": 3}
    for key, value in values.items():
        array = group[key]
        attrs = array.attrs["tierswap"]
        assert attrs["shape"] == list(value.shape)
        raw = np.asarray(array[:])
        if attrs["dtype"] == "bfloat16":
            restored = torch.from_numpy(raw.copy()).view(torch.bfloat16)
        else:
            restored = torch.from_numpy(raw.copy())
        assert torch.equal(restored.reshape(value.shape), value), key
    members = dict(group.members(max_depth=None))
    assert set(values) <= set(members)


def test_many_futures_in_flight(store_path: Path) -> None:
    io = ts.IOConfig(threads=4, inflight=8, block_bytes="64KiB")
    values = {f"k{i}": torch.randn(1000 + 37 * i) for i in range(64)}
    with ts.SwapStore(store_path, io=io, chunk_bytes="8KiB") as store:
        puts = [store.put_async(key, value) for key, value in values.items()]
        for future in puts:
            assert future.result() is None
        gets = {key: store.get_async(key) for key in values}
        for key, future in gets.items():
            assert torch.equal(future.result(), values[key])
        store.commit()
        assert store.stats()["bytes_written"] == sum(v.numel() * 4 for v in values.values())


def test_put_same_key_twice_keeps_the_latest(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        first = store.put_async("k", torch.zeros(50_000))
        second = store.put_async("k", torch.ones(50_000))
        first.result(), second.result()
        assert torch.equal(store.get("k"), torch.ones(50_000))
        store.commit()
        staging = store_path / ".tierswap" / "staging"
        assert not staging.exists() or not any(staging.iterdir())


def test_flipped_byte_is_detected(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        store.put("a/b", torch.arange(3000, dtype=torch.int32))
        store.put("fine", torch.ones(10))
        store.commit()
    chunk = store_path / "a" / "b" / "c" / "1"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    with ts.SwapStore(store_path) as store:
        with pytest.raises(CorruptionError, match=r"'a/b' chunk 1 .*CRC32C"):
            store.get("a/b")
        assert torch.equal(store.get("fine"), torch.ones(10))
        problems = store.verify()
        assert len(problems) == 1
        assert "'a/b' chunk 1" in problems[0]


def test_truncated_and_missing_chunks_are_detected(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        store.put("x", torch.arange(3000, dtype=torch.int32))
        store.commit()
    os.truncate(store_path / "x" / "c" / "2", 100)
    with ts.SwapStore(store_path) as store:
        with pytest.raises(CorruptionError, match="truncated"):
            store.get("x")
        assert any("chunk 2" in p for p in store.verify())
    (store_path / "x" / "c" / "0").unlink()
    with ts.SwapStore(store_path) as store, pytest.raises(CorruptionError, match="missing"):
        store.get("x")


def test_damaged_metadata_is_reported_not_fatal(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("bad", torch.ones(3))
        store.put("good", torch.ones(3))
        store.commit()
    (store_path / "bad" / "zarr.json").write_text("{not json")
    with ts.SwapStore(store_path) as store:
        assert store.keys() == ["bad", "good"]
        with pytest.raises(CorruptionError, match="bad"):
            store.get("bad")
        assert torch.equal(store.get("good"), torch.ones(3))
        assert any("bad" in p for p in store.verify())
        store.delete("bad")
        store.commit()
    with ts.SwapStore(store_path) as store:
        assert store.keys() == ["good"]
        assert store.verify() == []


@pytest.mark.parametrize("key", ["", "/a", "a/../b", "a\x00", ".tierswap/x", "a/zarr.json"])
def test_bad_keys_leave_store_unchanged(store_path: Path, key: str) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("ok", torch.ones(2))
        store.commit()
        with pytest.raises(InvalidKeyError):
            store.put(key, torch.ones(2))
        with pytest.raises(InvalidKeyError):
            store.get(key)
        assert store.keys() == ["ok"]
    assert sorted(p.name for p in store_path.iterdir()) == [".tierswap", "ok", "zarr.json"]


def test_array_and_group_names_cannot_clash(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("a/b", torch.ones(2))
        with pytest.raises(InvalidKeyError, match="group"):
            store.put("a", torch.ones(2))
        with pytest.raises(InvalidKeyError, match="nest"):
            store.put("a/b/c", torch.ones(2))
        store.delete("a/b")
        store.put("a", torch.ones(2))  # fine once the group is gone
        store.commit()
    assert zarr.open_group(store_path, mode="r")["a"].shape == (2,)


def test_missing_key(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        with pytest.raises(KeyNotFoundError, match="nope"):
            store.get("nope")
        with pytest.raises(KeyError):
            store.delete("nope")
        assert "nope" not in store


def test_one_writer_many_readers(store_path: Path) -> None:
    with ts.SwapStore(store_path) as writer:
        writer.put("x", torch.ones(3))
        writer.commit()
        with pytest.raises(StoreLockedError, match="mode='r'"):
            ts.SwapStore(store_path)
        with ts.SwapStore(store_path, mode="r") as reader:
            assert torch.equal(reader.get("x"), torch.ones(3))
            with pytest.raises(ReadOnlyError):
                reader.put("y", torch.ones(1))
            with pytest.raises(ReadOnlyError):
                reader.commit()
    with ts.SwapStore(store_path) as again:  # the lock was released at close
        assert again.keys() == ["x"]


def test_uncommitted_changes_are_discarded_on_reopen(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("kept", torch.ones(3))
        store.commit()
        store.put("kept", torch.zeros(3))
        store.put("new", torch.ones(3))
        store.delete("kept")
    with ts.SwapStore(store_path) as store:
        assert store.keys() == ["kept"]
        assert torch.equal(store.get("kept"), torch.ones(3))
        assert store.generation == 1


def test_disk_full_during_put_keeps_last_commit(store_path: Path, monkeypatch) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        store.put("x", torch.ones(5000))
        store.commit()

        calls = {"n": 0}
        real = os.pwritev

        def full_after_two(fd, buffers, offset):
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", full_after_two)
        with pytest.raises(OutOfSpaceError, match="disk full"):
            store.put("x", torch.zeros(5000))
        monkeypatch.setattr(os, "pwritev", real)
        assert torch.equal(store.get("x"), torch.ones(5000))
        staging = store_path / ".tierswap" / "staging"
        assert not staging.exists() or not any(staging.iterdir())
    with ts.SwapStore(store_path) as store:
        assert torch.equal(store.get("x"), torch.ones(5000))


def test_disk_full_during_commit_keeps_last_commit(store_path: Path, monkeypatch) -> None:
    from tierswap.store import _journal as journal

    with ts.SwapStore(store_path) as store:
        store.put("x", torch.ones(10))
        store.commit()
        store.put("x", torch.full((10,), 2.0))

        def no_space(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(journal, "write_journal", no_space)
        with pytest.raises(OutOfSpaceError):
            store.commit()
        assert store.generation == 1
        monkeypatch.undo()
        assert torch.equal(store.get("x"), torch.full((10,), 2.0))
        store.commit()  # retry succeeds
        assert store.generation == 2
    with ts.SwapStore(store_path) as store:
        assert torch.equal(store.get("x"), torch.full((10,), 2.0))


def test_scratch_store_writes_in_place(store_path: Path) -> None:
    with ts.SwapStore(store_path, durable=False, chunk_bytes="4KiB") as store:
        store.put("x", torch.arange(3000.0))
        store.put("x", torch.arange(10.0))  # fewer chunks: extra ones are removed
        assert sorted(os.listdir(store_path / "x" / "c")) == ["0"]
    with ts.SwapStore(store_path) as store:  # close() committed the metadata
        assert torch.equal(store.get("x"), torch.arange(10.0))
        root = json.loads((store_path / "zarr.json").read_text())
        assert root["attributes"]["tierswap"]["durable"] is False
    with ts.SwapStore(store_path, mode="r") as reader:
        assert reader.durable is False


def test_mode_w_wipes_and_refuses_foreign_folders(tmp_path: Path, store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("x", torch.ones(1))
        store.commit()
    with ts.SwapStore(store_path, mode="w") as store:
        assert store.keys() == []
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(ConfigError, match="not empty"):
        ts.SwapStore(foreign, mode="w")
    assert (foreign / "cat.jpg").exists()
    with pytest.raises(ConfigError, match="no store"):
        ts.SwapStore(tmp_path / "absent", mode="r")


def test_closed_store_and_bad_arguments(store_path: Path) -> None:
    store = ts.SwapStore(store_path)
    with pytest.raises(InvalidTensorError, match="Tensor"):
        store.put("x", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="JSON"):
        store.commit({"when": object()})
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.put("x", torch.ones(1))
    with pytest.raises(StoreClosedError):
        store.keys()
    with pytest.raises(ConfigError, match="mode"):
        ts.SwapStore(store_path, mode="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chunk_bytes"):
        ts.SwapStore(store_path, chunk_bytes=1000)


def test_buffered_fallback_round_trip(store_path: Path) -> None:
    with ts.SwapStore(store_path, io=ts.IOConfig(direct="off"), chunk_bytes="8KiB") as store:
        assert store.direct is False
        value = torch.randn(5001)
        store.put("x", value)
        store.commit()
        assert torch.equal(store.get("x"), value)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 2 MiB filesystem (tmpfs), where the machine lets us mount one."""
    import subprocess

    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_real_disk_full_keeps_last_commit(small_disk: Path) -> None:
    path = small_disk / "store"
    committed = torch.arange(100_000, dtype=torch.float32)  # 400 KB
    with ts.SwapStore(path, chunk_bytes="64KiB") as store:
        store.put("x", committed)
        store.commit({"step": 1})
        with pytest.raises(OutOfSpaceError, match="disk full"):
            store.put("x", torch.zeros(1_000_000))  # 4 MB on a 2 MiB disk
        with pytest.raises(OutOfSpaceError):
            store.put("y", torch.zeros(1_000_000))
        assert store.keys() == ["x"]
        assert torch.equal(store.get("x"), committed)
        store.put("small", torch.ones(10))  # the failed puts gave their space back
        store.commit({"step": 2})
    with ts.SwapStore(path) as store:
        assert torch.equal(store.get("x"), committed)
        assert store.meta == {"step": 2}
        assert store.verify() == []


def test_disk_use_stays_within_twice_the_state(store_path: Path) -> None:
    state = {f"k{i}": torch.randn(256 * 1024) for i in range(4)}  # 4 MiB in all
    nbytes = sum(v.numel() * 4 for v in state.values())
    slack = 64 * 4096  # metadata documents and folders
    with ts.SwapStore(store_path, chunk_bytes="256KiB") as store:
        for key, value in state.items():
            store.put(key, value)
        store.commit()
        assert store.disk_usage() <= nbytes + slack
        for key, value in state.items():  # a full overwrite, not yet committed
            store.put(key, value + 1)
        assert store.disk_usage() <= 2 * nbytes + slack
        written = store.stats()["bytes_written"]
        store.commit()
        assert store.stats()["bytes_written"] == written  # the commit rewrites no data byte
        # the old versions stay as spare write targets (see test_recycle.py): still within 2x
        assert store.disk_usage() <= 2 * nbytes + slack
        for key, value in state.items():
            store.put(key, value + 2)
        assert store.disk_usage() <= 2 * nbytes + slack
    assert ts.SwapStore(store_path, mode="r").disk_usage() <= nbytes + slack  # spares dropped
