"""A store on several folders (``SwapStore([A, B, ...])``, one per drive): placement, commits
across folders, crashes, locks, missing / unwritable / full folders, scratch mode."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import zarr

import tierswap as ts
from tests.store.faults import FaultyEngine
from tierswap.errors import ConfigError, OutOfSpaceError, StoreLockedError
from tierswap.store import _journal as journal

VALUES = {
    "a/x": torch.arange(40_000, dtype=torch.float32),
    "a/y": torch.full((9000,), 3.0, dtype=torch.float64),
    "b": torch.arange(100, dtype=torch.int16),
}


def _folders(tmp_path: Path, n: int = 3) -> list[Path]:
    return [tmp_path / f"drive{i}" / "run" for i in range(n)]


def _chunk_files(folder: Path) -> list[Path]:
    """Chunk files of the store's keys in ``folder`` (not its private folder)."""
    return [
        p
        for p in folder.rglob("*")
        if p.is_file() and p.parent.name == "c" and ".tierswap" not in p.relative_to(folder).parts
    ]


def _store(folders: Path | list[Path], **kwargs: object) -> ts.SwapStore:
    return ts.SwapStore(folders, chunk_bytes="4KiB", **kwargs)  # type: ignore[arg-type]


def _committed(
    folders: Path | list[Path], values: dict[str, torch.Tensor] = VALUES
) -> ts.SwapStore:
    store = _store(folders)
    for key, value in values.items():
        store.put(key, value)
    store.commit({"step": 1})
    return store


def _assert_holds(store: ts.SwapStore, values: dict[str, torch.Tensor]) -> None:
    assert store.keys() == sorted(values)
    for key, value in values.items():
        assert torch.equal(store.get(key), value), key
    assert store.verify() == []


def _abandon(store: ts.SwapStore) -> None:
    """Drop a store object as a killed process would: release its locks and threads only."""
    for engine in store._engines:
        engine.close()
    store._folder.unlock()
    store._closed = True


# ---------------------------------------------------------------- placement and format
def test_chunks_spread_over_every_folder_and_read_back(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    with _committed(folders) as store:
        assert store.paths == tuple(folders)
        _assert_holds(store, VALUES)
        counts = [len(_chunk_files(f)) for f in folders]
    assert all(counts), counts  # every folder holds chunks
    assert sum(counts) == 40 + 18 + 1  # 160000 B, 72000 B and 200 B in 4 KiB chunks
    assert not (folders[1] / "zarr.json").exists()  # metadata only in the home
    with ts.SwapStore(folders[0], mode="r") as reader:  # the home alone opens the whole store
        assert reader.paths == tuple(folders)
        assert reader.meta == {"step": 1}
        _assert_holds(reader, VALUES)


def test_a_list_of_one_folder_is_todays_format(tmp_path: Path) -> None:
    with _committed([tmp_path / "list"]), _committed(tmp_path / "plain"):
        pass
    listed = sorted(str(p.relative_to(tmp_path / "list")) for p in (tmp_path / "list").rglob("*"))
    plain = sorted(str(p.relative_to(tmp_path / "plain")) for p in (tmp_path / "plain").rglob("*"))
    assert listed == plain
    for rel in ("a/x/zarr.json", ".tierswap/zarr.json", "zarr.json"):
        assert (tmp_path / "list" / rel).read_bytes() == (tmp_path / "plain" / rel).read_bytes()


def test_weights_set_each_folders_share(tmp_path: Path) -> None:
    folders = _folders(tmp_path, 2)
    io = ts.IOConfig(weights={str(folders[0]): 3.0, str(folders[1]): 1.0})
    with _store(folders, io=io) as store:
        store.put("big", torch.zeros(256 * 1024, dtype=torch.int32))  # 256 chunks
        store.commit()
    counts = [len(_chunk_files(f)) for f in folders]
    assert counts == [192, 64]


def test_placement_is_recorded_so_new_weights_change_nothing_stored(tmp_path: Path) -> None:
    folders = _folders(tmp_path, 2)
    _committed(folders).close()
    before = {f: sorted(_chunk_files(f)) for f in folders}
    io = ts.IOConfig(weights={str(folders[0]): 1.0, str(folders[1]): 50.0})
    with _store(folders, io=io) as store:
        _assert_holds(store, VALUES)
        store.put_region("a/x", 10, torch.ones(20_000))  # a region write stays where it is
        store.commit()
    assert {f: sorted(_chunk_files(f)) for f in folders} == before


def test_zarr_python_refuses_an_array_on_several_folders_and_reads_one_in_the_home(
    tmp_path: Path,
) -> None:
    folders = _folders(tmp_path, 2)
    home_key = next(f"k{i}" for i in range(100) if not _store_folder_of(f"k{i}"))
    with _committed(folders, {**VALUES, home_key: torch.arange(10.0)}):
        pass
    doc = json.loads((folders[0] / "a" / "x" / "zarr.json").read_text())
    assert doc["tierswap_folders"]["must_understand"] is True
    assert len(doc["tierswap_folders"]["chunks"]) == 40
    with pytest.raises(Exception, match="tierswap_folders"):  # never zeros for missing chunks
        zarr.open_array(folders[0] / "a" / "x", mode="r")
    assert "tierswap_folders" not in json.loads((folders[0] / home_key / "zarr.json").read_text())
    array = zarr.open_array(folders[0] / home_key, mode="r")
    assert torch.equal(torch.from_numpy(array[:]), torch.arange(10.0))


def _store_folder_of(key: str) -> int:
    """The folder a one-chunk key of a two-folder store with equal weights goes to."""
    from tierswap.store._placement import Placement

    return (Placement([1.0, 1.0]).folders(key, 1) or (0,))[0]


# ---------------------------------------------------------------- commits, crashes
def test_delete_and_shrink_remove_files_in_every_folder(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    with _committed(folders) as store:
        store.delete("a/x")
        store.put("a/y", torch.ones(10, dtype=torch.float64))  # 18 chunks -> 1
        store.commit()
        _assert_holds(store, {"a/y": torch.ones(10, dtype=torch.float64), "b": VALUES["b"]})
    assert sum(len(_chunk_files(f)) for f in folders) == 2
    for folder in folders[1:]:
        assert not (folder / "a" / "x").exists()


def test_crash_before_the_commit_point_leaves_the_last_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = _folders(tmp_path)
    store = _committed(folders)
    store.put("a/x", torch.zeros(40_000))
    store.delete("b")

    def crash(*_args: object) -> None:
        raise OSError(errno.EIO, "power lost")

    monkeypatch.setattr(journal, "write_journal", crash)
    with pytest.raises(OSError, match="power lost"):
        store.commit()
    monkeypatch.undo()
    _abandon(store)
    with ts.SwapStore(folders[0]) as reopened:
        _assert_holds(reopened, VALUES)
    for folder in folders:
        assert not (folder / ".tierswap" / "staging").exists()


class _CrashError(Exception):
    pass


@pytest.mark.parametrize("after", [0, 1, 2, 6, 40])
def test_a_crash_at_any_rename_leaves_the_last_commit_or_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: int
) -> None:
    folders = _folders(tmp_path)
    store = _committed(folders)
    new = {"a/x": torch.arange(40_000.0) * 2, "c": torch.ones(20_000), "b": VALUES["b"]}
    store.delete("a/y")
    for key in ("a/x", "c"):
        store.put(key, new[key])
    real_replace, calls = os.replace, [0]

    def replace(src: object, dst: object) -> None:  # 'lose power' after some renames
        calls[0] += 1
        if calls[0] > after:
            raise _CrashError
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_CrashError):
        store.commit({"step": 2})
    monkeypatch.undo()
    _abandon(store)
    # the first rename puts the journal, the commit point, in place; the rest roll forward
    expected, meta = (VALUES, {"step": 1}) if after == 0 else (new, {"step": 2})
    with ts.SwapStore(folders[0], mode="r") as reader:  # a reader sees the commit already
        _assert_holds(reader, expected)
    with ts.SwapStore(folders) as writer:  # the next writer rolls it forward
        assert writer.meta == meta
        _assert_holds(writer, expected)
    assert not (folders[0] / ".tierswap" / journal.JOURNAL).exists()


def test_scratch_store_on_several_folders(tmp_path: Path) -> None:
    folders = _folders(tmp_path, 2)
    with _store(folders, durable=False) as store:
        for key, value in VALUES.items():
            store.put(key, value)
        store.put("a/x", VALUES["a/x"] + 1)  # renamed over in place
        store.put_region("a/y", 5, torch.zeros(100, dtype=torch.float64))
    expected = {**VALUES, "a/x": VALUES["a/x"] + 1, "a/y": VALUES["a/y"].clone()}
    expected["a/y"][5:105] = 0
    with ts.SwapStore(folders[0], mode="r") as reader:
        assert not reader.durable
        _assert_holds(reader, expected)
    assert not [p for f in folders for p in f.rglob("*.partial")]


def test_folders_with_and_without_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine per folder: a folder whose filesystem refuses O_DIRECT (tmpfs) is written
    buffered and synced per file beside a folder written with O_DIRECT."""
    from tierswap.io import _engine

    folders = _folders(tmp_path, 2)
    real = _engine._probe_write
    monkeypatch.setattr(
        _engine, "_probe_write", lambda d: False if folders[1] in d.parents else real(d)
    )
    with _committed(folders) as store:
        assert [e.direct for e in store._engines][1] is False
        assert not store.direct
        store.put("a/x", VALUES["a/x"] * 3)
        store.commit()
        _assert_holds(store, {**VALUES, "a/x": VALUES["a/x"] * 3})


# ---------------------------------------------------------------- locks and bad folders
def test_a_second_writer_on_any_folder_is_refused(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    other = tmp_path / "other"
    with _committed(folders):
        with pytest.raises(StoreLockedError):
            ts.SwapStore(folders)
        with pytest.raises(StoreLockedError, match="drive2"):
            ts.SwapStore(folders[2])  # a folder of the open store, as a store of its own
        with pytest.raises(StoreLockedError, match="drive1"):
            ts.SwapStore([other, folders[1]])
        with ts.SwapStore(folders[0], mode="r") as reader:  # readers take no lock
            _assert_holds(reader, VALUES)
    assert not other.exists() or not (other / "zarr.json").exists()


def test_a_missing_folder_is_named_and_the_commit_stays(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    _committed(folders).close()
    away = tmp_path / "unmounted"
    folders[1].rename(away)
    for mode in ("a", "r"):
        with pytest.raises(ConfigError, match=rf"folder 1 .*{folders[1]}.* is missing"):
            ts.SwapStore(folders[0], mode=mode)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="is missing"):
            ts.SwapStore(folders, mode=mode)  # type: ignore[arg-type]
    folders[1].mkdir()  # an empty mount point: not the folder of the store
    with pytest.raises(ConfigError, match="holds no part of the store"):
        ts.SwapStore(folders)
    folders[1].rmdir()
    away.rename(folders[1])
    with ts.SwapStore(folders) as store:
        _assert_holds(store, VALUES)


def test_folders_out_of_order_or_of_another_store_are_refused(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    _committed(folders).close()
    with pytest.raises(ConfigError, match=r"is folder 2 of the store.*not folder 1"):
        ts.SwapStore([folders[0], folders[2], folders[1]])
    with pytest.raises(ConfigError, match="is folder 1 of the store whose home is"):
        ts.SwapStore(folders[1], mode="r")
    with pytest.raises(ConfigError, match="spans 3 folders"):
        ts.SwapStore(folders[:2])
    with pytest.raises(ConfigError, match="listed twice"):
        ts.SwapStore([tmp_path / "x", tmp_path / "x"])
    with pytest.raises(ConfigError, match="overlap"):
        ts.SwapStore([tmp_path / "x", tmp_path / "x" / "y"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "data.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not empty"):
        ts.SwapStore([tmp_path / "new", tmp_path / "full"])
    with ts.SwapStore(folders) as store:
        _assert_holds(store, VALUES)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_an_unwritable_folder_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    folders = _folders(tmp_path, 2)
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        if self.is_relative_to(folders[1]):
            raise OSError(code, os.strerror(code), str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(ConfigError, match=f"{folders[1]}.*cannot be written"):
        ts.SwapStore(folders)
    monkeypatch.undo()
    with ts.SwapStore(folders) as store:  # the failed open left no lock behind
        store.put("k", torch.ones(3))


def test_a_full_folder_fails_the_put_and_leaves_the_last_commit(tmp_path: Path) -> None:
    folders = _folders(tmp_path, 2)
    store = _committed(folders)
    store._chunks.engines[1] = FaultyEngine(  # the second drive is full, the home is not
        store._engines[1], fail={"write_file": {1}}, error=lambda: OSError(errno.ENOSPC, "full")
    )
    with pytest.raises(OutOfSpaceError, match=f"{folders[1]}"):
        store.put("a/x", torch.zeros(40_000))
    _assert_holds(store, VALUES)
    store.commit({"step": 2})  # the disk has room again
    store.close()
    with ts.SwapStore(folders[0], mode="r") as reader:
        _assert_holds(reader, VALUES)
    assert not [p for f in folders for p in (f / ".tierswap" / "staging").glob("*")]


def test_a_store_on_one_folder_spreads_to_new_folders(tmp_path: Path) -> None:
    home, extra = tmp_path / "home", tmp_path / "extra"
    _committed([home]).close()
    with _store([home, extra]) as store:  # a second drive added: the old chunks stay put
        _assert_holds(store, VALUES)
        assert _chunk_files(extra) == []
        store.put("a/x", VALUES["a/x"] + 5)  # a rewritten key is placed anew ...
        store.put("new", torch.ones(30_000))
        store.commit()
    moved = {p.name for p in _chunk_files(extra) if p.parent.parent.name == "x"}
    assert moved
    assert not {p.name for p in (home / "a" / "x" / "c").iterdir()} & moved  # ... moved once
    with ts.SwapStore(home, mode="r") as reader:
        assert reader.paths == (home, extra)
        _assert_holds(reader, {**VALUES, "a/x": VALUES["a/x"] + 5, "new": torch.ones(30_000)})
