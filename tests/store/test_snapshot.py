"""Snapshots: hard-linked copies of the last commit that neither side can change afterwards."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import tierswap as ts
from tierswap.cli import main as cli_main
from tierswap.store import _journal as journal
from tierswap.store import _snapshot as snapshot_module
from tierswap.store._snapshot import is_shared

OLD = {
    "a/x": torch.arange(3000.0),
    "b": torch.ones(9000, dtype=torch.bfloat16),
    "c": torch.zeros(7),
}


def _committed_store(path: Path) -> ts.SwapStore:
    store = ts.SwapStore(path, chunk_bytes="4KiB")
    for key, value in OLD.items():
        store.put(key, value)
    store.commit({"step": 1})
    return store


def _assert_holds(path: Path, expected: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    with ts.SwapStore(path, mode="r") as store:
        assert store.keys() == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(store.get(key), value), key
        assert store.verify() == []
        if meta is not None:
            assert store.meta == meta


def _files(path: Path) -> dict[str, os.stat_result]:
    return {str(p.relative_to(path)): p.stat() for p in path.rglob("*") if p.is_file() and p.stat()}


def _written(path: Path) -> dict[str, tuple[int, int, int]]:
    """Each file's inode, size and modification time: what a write would change (not the
    access time, which a read may move)."""
    return {name: (st.st_ino, st.st_size, st.st_mtime_ns) for name, st in _files(path).items()}


def test_snapshot_links_chunks_and_copies_documents(tmp_path: Path) -> None:
    with _committed_store(tmp_path / "live") as store:
        store.put("a/x", torch.full((3000,), 5.0))  # uncommitted: not part of the snapshot
        store.put("new", torch.ones(3))
        result = store.snapshot(tmp_path / "snap")
    assert result.generation == 1
    assert result.copied_bytes < 4096 * 2  # only the small documents were copied
    assert result.linked_bytes >= sum(v.numel() * v.element_size() for v in OLD.values())
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})
    files = _files(tmp_path / "snap")
    assert not any("journal" in rel or "staging" in rel for rel in files)
    for rel, st in files.items():
        if rel.endswith("zarr.json"):
            assert st.st_nlink == 1, rel  # documents are private copies
        else:
            assert st.st_nlink == 2, rel  # chunks are shared with the live folder
            assert is_shared(tmp_path / "snap" / rel)
    group = zarr.open_group(tmp_path / "snap", mode="r")  # zarr-python reads it too
    np.testing.assert_array_equal(group["a/x"][:], OLD["a/x"].numpy())


def test_live_commits_and_deletes_never_change_the_snapshot(tmp_path: Path) -> None:
    new = {"a/x": torch.full((3000,), 2.0), "d": torch.arange(10.0)}
    with _committed_store(tmp_path / "live") as store:
        store.snapshot(tmp_path / "snap")
        store.delete("b")
        store.delete("c")
        for key, value in new.items():
            store.put(key, value)
        store.commit({"step": 2})
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})
    _assert_holds(tmp_path / "live", new, {"step": 2})
    shutil.rmtree(tmp_path / "live")
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})


def test_snapshot_writes_and_deletion_never_change_the_live_store(tmp_path: Path) -> None:
    with _committed_store(tmp_path / "live") as store:
        store.snapshot(tmp_path / "snap")
    for durable in (True, False):
        with ts.SwapStore(tmp_path / "snap", durable=durable) as snap:
            snap.put("a/x", torch.full((3000,), 9.0))
            if "c" in snap:
                snap.delete("c")
            snap.commit()
    _assert_holds(tmp_path / "live", OLD, {"step": 1})
    shutil.rmtree(tmp_path / "snap")
    _assert_holds(tmp_path / "live", OLD, {"step": 1})


def _abandon(store: ts.SwapStore) -> None:
    """Drop a store object as a killed process would."""
    store._engine.close()
    store._folder.unlock()
    store._closed = True


def test_crash_of_the_live_store_leaves_the_snapshot(tmp_path: Path) -> None:
    store = _committed_store(tmp_path / "live")
    store.snapshot(tmp_path / "snap")
    store.put("a/x", torch.full((3000,), 3.0))
    _abandon(store)  # staged files left behind
    with ts.SwapStore(tmp_path / "live") as reopened:  # recovery discards the staged files
        assert reopened.generation == 1
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})
    _assert_holds(tmp_path / "live", OLD, {"step": 1})


class _CrashError(Exception):
    pass


def test_snapshot_with_a_pending_roll_forward_takes_the_new_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = {"a/x": torch.arange(10.0), "e": torch.full((5000,), 4.0)}
    store = _committed_store(tmp_path / "live")
    store.delete("b")
    store.delete("c")
    for key, value in new.items():
        store.put(key, value)
    real_replace = os.replace
    calls = {"n": 0}

    def replace(src, dst):  # 'lose power' after two renames of the roll-forward
        calls["n"] += 1
        if calls["n"] > 2:
            raise _CrashError
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_CrashError):
        store.commit({"step": 2})
    monkeypatch.undo()
    _abandon(store)
    assert (tmp_path / "live" / ".tierswap" / journal.JOURNAL).exists()
    with ts.SwapStore(tmp_path / "live", mode="r") as reader:
        result = reader.snapshot(tmp_path / "snap")
    assert result.generation == 2
    _assert_holds(tmp_path / "snap", new, {"step": 2})
    assert (
        tmp_path / "live" / ".tierswap" / journal.JOURNAL
    ).exists()  # the reader changed nothing
    with ts.SwapStore(tmp_path / "live") as writer:  # the roll-forward moves files, not data
        assert writer.verify() == []
    _assert_holds(tmp_path / "snap", new, {"step": 2})


def _link_fails_outside(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend every folder but the store's own is on another filesystem."""
    real_link = os.link

    def link(src, dst, *args, **kwargs):
        if not Path(dst).is_relative_to(root):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)


def test_cross_filesystem_snapshot_copies_with_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _link_fails_outside(tmp_path / "live", monkeypatch)
    seen: list[tuple[int, int]] = []
    with _committed_store(tmp_path / "live") as store:
        result = store.snapshot(tmp_path / "snap", progress=lambda d, t: seen.append((d, t)))
        store.put("a/x", torch.full((3000,), 2.0))
        store.commit()
    assert result.linked_bytes == 0
    assert seen[-1][0] == seen[-1][1] >= sum(v.numel() * v.element_size() for v in OLD.values())
    assert all(st.st_nlink == 1 for st in _files(tmp_path / "snap").values())
    assert not list((tmp_path / "live" / ".tierswap").glob("snapshot-pin-*"))  # pins removed
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})
    assert (tmp_path / "live" / "b" / "c" / "0").stat().st_nlink == 1  # nothing keeps a link


def test_snapshot_copies_where_no_hard_links_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def link(*_args, **_kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", link)
    with _committed_store(tmp_path / "live") as store:
        store.snapshot(tmp_path / "snap", progress=False)
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})


def test_verify_finds_a_damaged_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _link_fails_outside(tmp_path / "live", monkeypatch)
    with _committed_store(tmp_path / "live") as store:
        store.snapshot(tmp_path / "snap")
    chunk = tmp_path / "snap" / "a" / "x" / "c" / "1"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    (tmp_path / "snap" / "c" / "zarr.json").write_text("{")
    assert cli_main(["verify", str(tmp_path / "snap")]) == 1
    with ts.SwapStore(tmp_path / "snap", mode="r") as snap:
        problems = snap.verify()
    assert any("'a/x' chunk 1" in p for p in problems)
    assert any("'c'" in p for p in problems)
    _assert_holds(tmp_path / "live", OLD)


def test_snapshot_errors_change_nothing(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("keep")
    with _committed_store(tmp_path / "live") as store, ts.SwapStore(tmp_path / "other") as other:
        before = _written(tmp_path / "live")
        with pytest.raises(ts.errors.SnapshotExistsError, match="not empty"):
            store.snapshot(tmp_path / "full")
        with pytest.raises(ts.errors.StoreLockedError, match="open for writing"):
            store.snapshot(tmp_path / "other")
        with pytest.raises(ts.errors.ConfigError, match="overlaps"):
            store.snapshot(tmp_path / "live" / "inside")
        with pytest.raises(ts.errors.NoCommitError, match="no commit"):
            other.snapshot(tmp_path / "never")
        assert _written(tmp_path / "live") == before
        assert other.keys() == []
    assert (tmp_path / "full" / "file").read_text() == "keep"
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "live", "other"]


def test_scratch_store_with_uncommitted_changes_refuses(tmp_path: Path) -> None:
    with ts.SwapStore(tmp_path / "live", durable=False) as store:
        store.put("x", torch.ones(10))
        store.commit()
        store.put("x", torch.zeros(10))  # written in place: the commit is no longer on disk
        with pytest.raises(ts.errors.NoCommitError, match="scratch"):
            store.snapshot(tmp_path / "snap")
        store.commit()
        store.snapshot(tmp_path / "snap")
    _assert_holds(tmp_path / "snap", {"x": torch.zeros(10)})


def test_is_shared_is_the_recycling_rule(tmp_path: Path) -> None:
    """The store must never write into, or recycle, a chunk file a snapshot still links."""
    with _committed_store(tmp_path / "live") as store:
        chunk = tmp_path / "live" / "c" / "c" / "0"
        assert not is_shared(chunk)
        store.snapshot(tmp_path / "snap")
        assert is_shared(chunk)
        assert is_shared(tmp_path / "snap" / "c" / "c" / "0")
    assert not is_shared(tmp_path / "missing")
    shutil.rmtree(tmp_path / "snap")
    assert not is_shared(chunk)


def test_replace_with_snapshot_resets_a_store_folder(tmp_path: Path) -> None:
    with _committed_store(tmp_path / "live") as store:
        store.snapshot(tmp_path / "snap")
        store.put("a/x", torch.zeros(3000))
        store.commit({"step": 2})
        with pytest.raises(ts.errors.StoreLockedError):
            snapshot_module.replace_with_snapshot(tmp_path / "snap", tmp_path / "live")
    snapshot_module.replace_with_snapshot(tmp_path / "snap", tmp_path / "live")
    _assert_holds(tmp_path / "live", OLD, {"step": 1})
    _assert_holds(tmp_path / "snap", OLD, {"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "snap"]


def test_cli_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _committed_store(tmp_path / "live").close()
    assert cli_main(["snapshot", str(tmp_path / "live"), str(tmp_path / "snap")]) == 0
    assert "generation 1" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path / "snap")]) == 0
    assert cli_main(["snapshot", str(tmp_path / "live"), str(tmp_path / "snap")]) == 2
    assert "not empty" in capsys.readouterr().err
