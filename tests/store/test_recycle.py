"""Spare chunk files: superseded versions reused as write targets, never when shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.store._recycle import SparePool

CHUNK = 64 * 1024


def _inodes(folder: Path) -> set[int]:
    return {p.stat().st_ino for p in folder.rglob("c/*")}


def test_steady_state_writes_reuse_superseded_files(store_path: Path) -> None:
    value = torch.randn(8 * CHUNK // 4)  # eight whole chunks
    with ts.SwapStore(store_path, chunk_bytes=CHUNK) as store:
        store.put("x", value)
        store.commit()
        first = _inodes(store_path)
        store.put_region("x", 0, value + 1)
        store.commit()
        store.put_region("x", 0, value + 2)  # written into the versions the last commit replaced
        store.commit()
        assert _inodes(store_path) == first  # no new file was allocated for the third version
        assert torch.equal(store.get("x"), value + 2)
        assert store.verify() == []
    with ts.SwapStore(store_path, mode="r") as store:
        assert torch.equal(store.get("x"), value + 2)


def test_uncommitted_versions_are_recycled_within_a_generation(store_path: Path) -> None:
    value = torch.randn(4 * CHUNK // 4)
    with ts.SwapStore(store_path, chunk_bytes=CHUNK) as store:
        store.put("x", value)
        store.commit()
        for step in range(1, 5):  # several versions before one commit (commit_every > 1)
            store.put_region("x", 0, value + step)
        staging = store_path / ".tierswap" / "staging"
        spare = store_path / ".tierswap" / "spare"
        files = len(list(staging.iterdir())) + len(list(spare.iterdir()))
        assert files <= 4 + 4  # one version staged, at most one superseded per chunk
        store.commit()
        assert torch.equal(store.get("x"), value + 4)
    with ts.SwapStore(store_path) as store:
        assert torch.equal(store.get("x"), value + 4)


@pytest.mark.parametrize("made_by", ["create", "put"])
def test_versions_of_an_array_not_committed_yet_are_recycled(
    store_path: Path, made_by: str
) -> None:
    """An array made since the last commit (the state a first step creates, under
    ``commit_every`` > 1, or a key the swap API puts and puts again) recycles its superseded
    staged versions too: the spares may hold as many bytes as the current arrays, not only as
    the committed ones (none here)."""
    value = torch.randn(4 * CHUNK // 4)
    spare = store_path / ".tierswap" / "spare"
    with ts.SwapStore(store_path, chunk_bytes=CHUNK) as store:
        if made_by == "create":  # nothing committed
            store.create("x", value.shape, value.dtype)
        else:
            store.put("x", value - 1)
        for step in range(3):
            if made_by == "create":
                store.put_region("x", 0, value + step)
            else:
                store.put("x", value + step)
            # the version it superseded is kept for the next write (it took the one before)
            assert len([p for p in spare.iterdir() if p.is_file()]) == 4
        store.commit()
        assert torch.equal(store.get("x"), value + 2)
    with ts.SwapStore(store_path, mode="r") as store:
        assert torch.equal(store.get("x"), value + 2)
        assert store.verify() == []


def test_a_file_a_snapshot_links_is_never_written_in_place(store_path: Path, tmp_path) -> None:
    value = torch.randn(4 * CHUNK // 4)
    with ts.SwapStore(store_path, chunk_bytes=CHUNK) as store:
        store.put("x", value)
        store.commit()
        store.snapshot(tmp_path / "snap")
        linked = _inodes(tmp_path / "snap")
        store.put_region("x", 0, value + 1)
        store.commit()  # the snapshot's files leave the live folder (as spares, still linked)
        store.put_region("x", 0, value + 2)  # must not overwrite them
        store.commit()
        assert not linked & _inodes(store_path)
    with ts.SwapStore(tmp_path / "snap", mode="r") as snap:
        assert torch.equal(snap.get("x"), value)
        assert snap.verify() == []


def test_pool_respects_its_cap_and_the_sharing_rule(tmp_path: Path) -> None:
    pool = SparePool(tmp_path / "spare")
    pool.cap = 4096
    files = []
    for i in range(3):
        path = tmp_path / f"old{i}"
        path.write_bytes(b"x" * 4096)
        files.append(path)
    os.link(files[0], tmp_path / "snapshot-link")
    pool.keep(files)
    assert pool.nbytes == 4096  # the shared one left the pool, the last was over the cap
    assert not any(f.exists() for f in files)
    pool.settle()  # the one over the cap is deleted on the pool's thread
    assert len(list(pool.folder.iterdir())) == 1
    assert (tmp_path / "snapshot-link").read_bytes() == b"x" * 4096
    target = tmp_path / "target"
    assert pool.take(4096, target)
    assert target.exists()
    assert not pool.take(4096, tmp_path / "again")
    assert not pool.take(8192, tmp_path / "other")
