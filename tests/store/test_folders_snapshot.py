"""Snapshots of a store on several folders: into a list of folders or one folder, restores,
and the CLI (inspect, verify, snapshot) on such stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tests.store.test_folders import VALUES, _assert_holds, _chunk_files, _committed, _folders
from tierswap.cli import main as cli_main
from tierswap.errors import ConfigError
from tierswap.store import replace_with_snapshot


def _store_id(folder: Path) -> str:
    doc = json.loads((folder / ".tierswap" / "zarr.json").read_text())
    return str(doc["attributes"]["tierswap"]["store"])


def test_snapshot_into_one_folder_per_drive_links_every_chunk(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    dests = [f.with_name("snap") for f in folders]  # beside each source, on its drive
    with _committed(folders) as store:
        result = store.snapshot(dests)
        store.put("a/x", torch.zeros(40_000))
        store.commit({"step": 2})
    assert result.path == dests[0]
    assert result.linked_bytes == 59 * 4096
    assert result.generation == 1
    for dest in dests:  # a/y is unchanged: the live store and the snapshot share its files
        links = [p.stat().st_nlink for p in dest.glob("a/y/c/*")]
        assert links
        assert set(links) == {2}
    assert len({_store_id(d) for d in dests}) == 1
    assert _store_id(dests[0]) != _store_id(folders[0])  # a store of its own
    with ts.SwapStore(dests[0], mode="r") as snap:  # its home lists its own folders
        assert snap.paths == tuple(dests)
        assert snap.meta == {"step": 1}
        _assert_holds(snap, VALUES)


def test_snapshot_into_one_folder_nests_the_other_folders(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    with _committed(folders) as store:
        store.snapshot(tmp_path / "ckpt" / "optimizer.tierswap")
    moved = tmp_path / "elsewhere"
    (tmp_path / "ckpt").rename(moved)  # a checkpoint folder is moved as one folder
    snap = moved / "optimizer.tierswap"
    assert (snap / ".tierswap" / "folder-1" / ".tierswap" / "zarr.json").exists()
    with ts.SwapStore(snap) as store:  # opens, writes and commits like any store
        assert store.paths == (snap, snap / ".tierswap/folder-1", snap / ".tierswap/folder-2")
        _assert_holds(store, VALUES)
        store.put("new", torch.ones(20_000))
        store.commit()
        usage = store.folder_usage()
    assert len(usage) == 3
    assert store.disk_usage() == sum(usage.values())
    assert cli_main(["verify", str(snap)]) == 0


def test_a_destination_list_must_match_the_folders(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    with _committed(folders) as store, pytest.raises(ConfigError, match="spans 3 folders"):
        store.snapshot([tmp_path / "s0", tmp_path / "s1"])
    assert not (tmp_path / "s0").exists()


def test_replace_with_snapshot_restores_every_folder(tmp_path: Path) -> None:
    folders = _folders(tmp_path)
    with _committed(folders) as store:
        store.snapshot(tmp_path / "snap")
        store.put("a/x", torch.zeros(40_000))
        store.delete("b")
        store.commit({"step": 2})
    replace_with_snapshot(tmp_path / "snap", folders)
    with ts.SwapStore(folders[0]) as restored:
        assert restored.paths == tuple(folders)
        assert restored.meta == {"step": 1}
        _assert_holds(restored, VALUES)
    assert all(_chunk_files(f) for f in folders)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_cli_on_a_store_on_several_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folders = _folders(tmp_path)
    _committed(folders).close()
    assert cli_main(["inspect", str(folders[0])]) == 0
    text = capsys.readouterr().out
    assert "folders" in text
    assert str(folders[2]) in text
    assert cli_main(["inspect", "--json", *map(str, folders)]) == 0
    described = json.loads(capsys.readouterr().out)
    assert [f["path"] for f in described["folders"]] == [str(f) for f in folders]
    assert all(f["disk_bytes"] > 0 for f in described["folders"])
    dests = [str(f.with_name("snap")) for f in folders]
    assert cli_main(["snapshot", str(folders[0]), *dests]) == 0
    assert "generation 1" in capsys.readouterr().out
    assert cli_main(["verify", dests[0]]) == 0
    assert "intact: 3 arrays" in capsys.readouterr().out
    chunk = sorted(_chunk_files(folders[2]))[0]
    with open(chunk, "r+b") as fh:  # flip a byte on the third drive
        fh.seek(7)
        byte = fh.read(1)
        fh.seek(7)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert cli_main(["verify", str(folders[0])]) == 1
    out = capsys.readouterr().out
    assert "CRC32C" in out
    assert str(chunk) in out
    capsys.readouterr()
    assert cli_main(["verify", str(folders[1])]) == 2  # not the home
    assert "open the store through its home folder" in capsys.readouterr().err
